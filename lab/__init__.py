"""The local two-site lab, as processes on this machine.

``site`` (sites of brokers and sidecars; ``TwoSites``), ``netns`` (corosync
sites in network namespaces), ``wan`` (the WAN emulator), ``client`` (an
AMQP test client), ``lifetime`` (start and stop as a context manager),
``corosyncconf`` (every corosync.conf, the lab's and deploy/corosync/'s),
``units`` (the systemd units run where PID 1 is not systemd).  The
lab imports no other drgate package: it starts ``drgate`` processes and
talks to them as an operator would.  Used by ``drgate demo``, ``drgate
lab``, the integration tests and the benchmarks.
"""
