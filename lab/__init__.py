"""The local lab: corosync sites in network namespaces (netns.py)."""
