"""The sidecar: tap, spool, egress at P; ingress at D (docs/architecture.md, sections 7 and 8).

Theory of operation
-------------------
A sidecar is a passive member of its site's bus (:class:`cluster.member.SiteMember`):
it holds the site state, joins by state transfer like a broker, and
multicasts nothing on the data path.  This module only composes the parts:

* at P, every sidecar taps the stream (:mod:`gateway.tap`) in stream order
  and appends the replication events to its spool (:mod:`gateway.spool`);
  the active one streams the spool to D (:mod:`gateway.egress`), and every
  one watches the rules file (:mod:`gateway.ruleswatch`);
* at D, the active sidecar applies P's stream to D's bus
  (:mod:`gateway.ingress`);
* which sidecar is active follows from the stream alone (:mod:`gateway.roles`).

A sidecar in a non-quorate view does nothing: no egress, no ingress.

A sidecar whose config links both ways (``peers`` and ``listen``: it is
*reversible*) has both an egress and an ingress, and which one works
follows the site's role now (:attr:`Sidecar.primary`): a planned
switchover swaps the sites' roles in place (cluster/state/switchover.py).
At the handover's cseq the new primary's sidecars start a new spool with
their ``SWAP`` event (:meth:`Tap.swap_event`) and tap from there; the old
primary's stop tapping once their site handed over, and take the new
primary's stream from its ``SWAP``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import trio

from cluster.addresses import Address
from cluster.bus import MemberId, ViewChange, open_bus
from cluster.member import BusOpener, NullObserver, SiteMember
from cluster.state.effects import Effect
from cluster.state.model import SiteState
from cluster.state.switchover import awaiting_swap
from cluster.tls import server_context
from gateway.capture import CaptureSink, Ingested, capture_role
from gateway.egress import Connector, Egress
from gateway.ingress import Ingress
from gateway.linkconnect import open_link
from gateway.peerswatch import PeersWatcher
from gateway.roles import (
    PRIMARY_ROLES,
    RoleSignal,
    SidecarRole,
    active_sidecar,
    role_of,
    runs_as_primary,
)
from gateway.ruleswatch import POLL_S as RULES_POLL_S
from gateway.ruleswatch import RulesWatcher
from gateway.sidecarconfig import SidecarConfig
from gateway.sidecarspool import discard_spool, missed_recoveries, open_spool
from gateway.spool import Spool
from gateway.statistics import SidecarStatistics, sidecar_snapshot
from gateway.tap import ReplEvent, Tap
from gateway.verification import Verifications, post_verify_points
from protocol import cluster as pc
from protocol import link
from protocol.errors import DrgateError
from protocol.modes import Role

log = logging.getLogger("drgate.sidecar")

# The largest event the tap hands to the spool: one event must fit in one
# link BATCH frame, with room for the frame's and the batch's headers.
MAX_EVENT_BYTES = link.DEFAULT_MAX_FRAME_BYTES - 4096
INSECURE_WARNING = (
    "the WAN link runs in plaintext (insecure: true in the sidecar config): replicated "
    "messages cross the network in clear and the peer site is not authenticated; "
    "give tls: {cert, key, ca} to run it with mutual TLS"
)


class Sidecar(NullObserver):
    """One sidecar.  ``await nursery.start(sidecar.serve)`` returns once it
    holds the site state and its link side runs."""

    def __init__(
        self,
        config: SidecarConfig,
        *,
        open_member: BusOpener = open_bus,
        connect: Connector | None = None,
    ) -> None:
        """``open_member`` joins the site bus and ``connect`` dials one of D's
        sidecars; tests pass in-memory ones."""
        self.config = config
        self.member = SiteMember(
            config.site, config.bus, role=Role.SIDECAR, observer=self, open_member=open_member
        )
        self.tap = Tap(config.rules, origin_cluster=config.site)
        self.rules_watch = RulesWatcher(config.rules.path)
        self.peers_watch = (
            PeersWatcher(config)
            if (config.primary or config.reversible) and config.source
            else None
        )
        self.spool: Spool | None = None
        self.roles = RoleSignal()
        self.verifications = Verifications()  # D: the last comparison of each replica
        self._events: list[ReplEvent] = []  # tapped from the frame being applied
        self._resync_wanted = False  # a command of the frame goes by a resync
        self._was_minority = False
        # The spool failed a write and this sidecar re-announced itself ready,
        # to go to the back of the ready order; it is no egress until that
        # MemberReady comes back (_step_back).  Once per disk outage.
        self._stepping_back = False
        self._stepped_back_in_outage = False
        self._was_primary = config.primary  # the role the spool and the tap run for
        self.capture: CaptureSink | None = None
        if config.capture is not None:
            self.capture = CaptureSink(
                config.capture,
                site=config.site,
                node=config.node,
                identity=lambda: (capture_role(self.current_role()), self.state.incarnation),
                rules=lambda: self.tap.rules,
            )
        self.egress: Egress | None = None
        self.ingress: Ingress | None = None
        if config.primary or config.reversible:
            self.egress = Egress(
                config,
                self.member,
                self.tap,
                spool=lambda: self.spool,
                role=self.current_role,
                roles=self.roles,
                connect=connect or self._connect,
                capture=self.capture,
            )
        if not config.primary or config.reversible:
            self.ingress = Ingress(
                config,
                self.member,
                role=self.current_role,
                active=self.active_sidecar,
                ssl_context=None if config.tls is None else server_context(config.tls),
                pinned=config.pinned_names,
            )

    @property
    def state(self) -> SiteState:
        return self.member.state

    @property
    def link_port(self) -> int | None:
        """D: the bound link port."""
        return None if self.ingress is None else self.ingress.link_port

    # ------------------------------------------------------------------
    # Roles
    # ------------------------------------------------------------------

    @property
    def primary(self) -> bool:
        """Does this sidecar's site run as the primary now (:func:`runs_as_primary`)?"""
        config = self.config
        return runs_as_primary(
            self.member.state, configured=config.primary, reversible=config.reversible
        )

    @property
    def link_side(self) -> Egress | Ingress:
        """The half of the link this sidecar's site runs now."""
        side = self.egress if self.primary else self.ingress
        assert side is not None
        return side

    def current_role(self) -> SidecarRole:
        m = self.member
        role = role_of(m.me, m.state, m.membership, ready=m.ready.is_set(), primary=self.primary)
        if role == SidecarRole.EGRESS and self._stepping_back:
            return SidecarRole.STANDBY
        return role

    def active_sidecar(self) -> MemberId | None:
        return active_sidecar(self.member.state, self.member.membership)

    def _roles_may_have_changed(self) -> None:
        self.roles.changed()
        if self.egress is not None:
            self.egress.wake()

    # ------------------------------------------------------------------
    # The stream (called by the member's applier, in order; never waits)
    # ------------------------------------------------------------------

    def after_command(
        self, cmd: pc.Command, effects: Sequence[Effect], sender: MemberId, own: bool
    ) -> None:
        """``cmd`` was applied (its cseq is the state's)."""
        if isinstance(cmd, pc.MemberReady):
            if own:
                self._stepping_back = False  # at the back of the order now
            self._roles_may_have_changed()
        if isinstance(cmd, pc.Durable):
            self._durable_advanced()  # held acks (D), or events held back (P), may go
        was_primary = self._was_primary  # the role this command was applied in
        if self.primary != was_primary:
            if self.member.ready.is_set():
                self._swap_roles()
            else:  # joining: serve() opens the spool for the role it finds
                self._was_primary = self.primary
        if not was_primary:
            if self.state.incarnation == 0:
                # Not the site's state yet: its brokers' recovery will replace
                # it (a start over applies what it buffered to an empty
                # state).  No copy to compare, no application to capture.
                return
            if isinstance(cmd, pc.Replicated):
                self.verifications.record(effects)
            if self.capture is not None and isinstance(cmd, Ingested):
                self.capture.ingested(cmd, effects, self.state.cseq)
            return
        if isinstance(cmd, pc.AckWatermark) and self.spool is not None and not own:
            if cmd.origin_cluster == self.config.site:
                self.spool.trim(cmd.cseq)
            return
        requested = self.tap.resyncs_requested
        try:
            event = self.tap.on_command(self.state, cmd, effects, int(time.time() * 1e6))
            if event is not None and len(event.payload) > MAX_EVENT_BYTES:
                raise DrgateError(
                    f"its event of {len(event.payload)} bytes exceeds the {MAX_EVENT_BYTES} "
                    "bytes one link batch can carry"
                )
        except Exception as exc:  # a limit or a bug in one command's tapping
            self._tap_failed(cmd, exc)
            return
        if self.tap.resyncs_requested != requested:
            self._resync_wanted = True
            log.info(
                "tap: the %s command at cseq %d is too big for one event; D is resynced past it",
                pc.Kind(cmd.KIND).name,
                self.state.cseq,
            )
        if self.capture is not None:
            self.capture.tapped(cmd, effects, event, self.state.cseq, self.tap.rules)
        if event is not None:
            self._events.append(event)

    def _swap_roles(self) -> None:
        """The site's role flipped at this command (only for a reversible
        config).  Becoming the primary by the other site's handover (applied
        here): a new spool, whose first event is the ``SWAP`` that makes the
        other site its DR site; by a failback (the handover undone) or a
        failback by delta's ``ADOPT``: a new spool from here, and the other
        site is resynced.  Becoming the DR site (it handed over, a failback
        at D ended the role the handover gave it, or a failback by delta's
        ``REJOIN``): the spool is done with, nothing is tapped."""
        primary = self._was_primary = self.primary
        self._discard_spool()
        state, site, peer = self.state, self.config.site, self.config.peer_cluster
        if not primary:
            log.info(
                "sidecar: %s is not the primary from cseq %d; it takes %s's stream from %s",
                site,
                state.cseq,
                peer,
                "its SWAP" if awaiting_swap(state, peer) else "its next link",
            )
        elif peer in state.handovers:
            self.tap.resync_rules(state)
            self.spool = self._open_spool(start_after=state.cseq - 1)
            self._events.append(self.tap.swap_event(state, peer, int(time.time() * 1e6)))
            log.info(
                "sidecar: %s is the primary from cseq %d (a planned switchover); %s becomes "
                "its DR site at this point of its stream",
                site,
                state.cseq,
                peer,
            )
        else:
            self.tap.resync_rules(state)
            self.spool = self._open_spool()
            log.info("sidecar: %s is the primary from cseq %d; %s resyncs", site, state.cseq, peer)
        self._roles_may_have_changed()

    def _discard_spool(self) -> None:
        discard_spool(self.spool, self.config.spool_dir)
        self.spool = None
        self._events.clear()

    def _tap_failed(self, cmd: pc.Command, exc: Exception) -> None:
        """The tap could not forward ``cmd``: the sidecar goes on, and the
        stream carries a gap at this cseq (the tap's next event names it as
        its previous one), so the spool raises its floor past it and any D
        behind it is resynced, which carries the state this command made.
        Every tap of the site fails the same command the same way."""
        cseq = self.state.cseq
        self.tap.last_seq = cseq
        self.tap.dropped["tap_failure"] += 1
        self.tap.last_error = (
            f"tap: the {pc.Kind(cmd.KIND).name} command at cseq {cseq} was not forwarded "
            f"({type(exc).__name__}: {exc}); D is resynced past it"
        )
        log.error("%s", self.tap.last_error, exc_info=not isinstance(exc, DrgateError))
        self._resync_wanted = True

    def after_frame(self) -> None:
        """Every command of a delivered frame was applied: spool its events."""
        if self._resync_wanted and self.egress is not None:
            self.egress.request_resync()  # the gap is closed now, not at the next event
        self._resync_wanted = False
        if not self._events:
            return
        if self.spool is not None and self.egress is not None:
            # Never raises for a failing disk: the spool raises its floor instead.
            self.spool.append_many((e.seq, e.time_us, e.payload, e.prev_seq) for e in self._events)
            if self.spool.failing != self._stepped_back_in_outage:
                self._stepped_back_in_outage = self.spool.failing
                if self.spool.failing:
                    self._step_back()
            self.egress.wake()
        self._events.clear()

    def _step_back(self) -> None:
        """The spool lost events to a failing disk, which the other sidecars
        of the site hold in theirs: re-announce this one ready, which puts it
        at the back of the ready order, so the link moves to the sidecar
        ready longest after it, which resumes D without a resync (a resync of
        an ``enqueue`` queue cannot bring back what P's consumers took;
        found by tests/chaos).  Alone, it keeps the link and D resyncs."""
        me, membership = self.member.me, self.member.membership
        if me is None or membership is None:
            return
        ready = [
            MemberId(*key)
            for key, role in self.state.ready.items()
            if role == Role.SIDECAR and MemberId(*key) in membership.members
        ]
        if me not in ready or ready[-1] == me:
            return
        log.warning(
            "sidecar: the spool lost events to a failing disk; stepping back behind "
            "node(s) %s, whose spools hold them, so that the link goes to them first",
            [m.node for m in ready[ready.index(me) + 1 :]],
        )
        self._stepping_back = True
        self.member.post(pc.MemberReady(Role.SIDECAR, me.node, me.pid))
        self._roles_may_have_changed()

    def on_rejoin(self) -> None:
        """The state is stale: the spool holds events numbered by the
        minority's stream, which mean nothing to the site any more.  It
        reopens empty after the snapshot."""
        self._discard_spool()
        self._roles_may_have_changed()

    def _durable_advanced(self) -> None:
        """The site's durable watermark may have moved."""
        if self.ingress is not None:
            self.ingress.durable.advanced()
        if self.egress is not None:
            self.egress.wake()

    def after_restore(self) -> None:
        """A snapshot replaced the state: reopen the spool after a rejoin."""
        self._durable_advanced()
        if self.spool is not None or not self.member.ready.is_set():
            return  # the first join: serve() opens the spool
        self.tap.resync_rules(self.state)
        self.spool = self._open_spool()
        self._was_primary = self.primary
        self._roles_may_have_changed()

    def view_seen(self, view: ViewChange) -> None:
        if not view.quorate:
            log.warning("%s", self.minority_text(view))
        elif self.member.membership is not None and self._was_minority:
            log.info("view quorate again (%d members): roles resume", len(view.members))
        self._was_minority = not view.quorate
        self._roles_may_have_changed()

    def minority_text_now(self) -> str:
        membership = self.member.membership
        members = () if membership is None else membership.members
        return self.minority_text(ViewChange(0, members, (), (), False))

    @staticmethod
    def minority_text(view: ViewChange) -> str:
        return (
            f"in a minority partition: the view of {len(view.members)} members is not "
            "quorate, so this sidecar neither forwards nor ingests until the partition heals"
        )

    def _open_spool(self, *, start_after: int | None = None) -> Spool:
        """The spool (:func:`open_spool`); D is resynced past the whole-site
        recoveries it did not see (:func:`missed_recoveries`)."""
        spool = open_spool(self.config, self.state, start_after=start_after)
        missed = missed_recoveries(spool, self.state)
        if missed and self.egress is not None:
            log.info(
                "sidecar: whole-site recoveries %s (continued from cseqs %s) dropped transient "
                "state this sidecar's spool did not see; D is resynced",
                [r.count for r in missed],
                [r.cseq for r in missed],
            )
            self.egress.request_resync()
        return spool

    # ------------------------------------------------------------------
    # Service
    # ------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.capture is not None:
                await nursery.start(self.capture.serve)
            await nursery.start(self.member.serve)
            if not self.member.site_live.is_set():
                # A site restarted whole waits for its brokers' journals; the
                # recovered state arrives as a restore (after_restore).
                log.info("sidecar: the site recovers from its brokers' journals; waiting")
                await self.member.site_live.wait()
            # Events tapped before the spool opens were part of the snapshot
            # or of the genesis; the spool starts above the current cseq.
            if self.spool is None:
                self.tap.resync_rules(self.state)
                self.spool = self._open_spool()
            self._was_primary = self.primary
            if self.egress is not None:
                nursery.start_soon(self.egress.serve)
                nursery.start_soon(self._watch_rules)
                if self.config.link.verify_s:
                    nursery.start_soon(
                        post_verify_points,
                        self.member,
                        self.config.link.verify_s,
                        lambda: self.current_role() == SidecarRole.EGRESS,
                    )
            if self.ingress is not None:
                assert self.config.listen is not None
                listen = self.config.listen
                await nursery.start(self.ingress.serve, listen.host, listen.port)
            if self.config.tls is None:
                log.warning("%s", INSECURE_WARNING)
            log.info("sidecar ready role=%s cseq=%d", self.current_role(), self.state.cseq)
            task_status.started()

    async def _watch_rules(self) -> None:
        """Propose a changed, valid rules file to the site (gateway/ruleswatch.py);
        take a changed ``peers`` list (gateway/peerswatch.py)."""
        watcher = self.rules_watch
        watcher.start_from()  # the file as loaded; only later edits are proposed
        if self.peers_watch is not None:
            self.peers_watch.start_from()
        if self.tap.rules.digest != self.config.rules.digest:
            log.warning(
                "rules: %s differs from the rules in force (version %d, switched at cseq %s); "
                "it is proposed only once it is edited",
                watcher.path,
                self.tap.rules.rules_version,
                self.tap.rules.cseq,
            )
        while True:
            await trio.sleep(RULES_POLL_S)  # polling a file: there is no event to await
            if self.peers_watch is not None and self.egress is not None:
                peers = self.peers_watch.poll(self.egress.peers)
                if peers is not None:
                    self.egress.set_peers(peers)
            if self.current_role() not in PRIMARY_ROLES:
                continue  # not from a minority, nor before the state is here
            payload = watcher.poll(self.tap.rules)
            if payload is not None:
                await self.member.submit(pc.RulesSwitch(payload.to_bytes()))

    async def _connect(self, address: Address) -> trio.abc.Stream:
        """A connection to one of D's sidecars (gateway/egress.py ``open_link``)."""
        config = self.config
        return await open_link(
            address, tls=config.tls, pinned=config.pinned_names, site=config.site
        )

    # ------------------------------------------------------------------

    def statistics(self) -> SidecarStatistics:
        """The snapshot metrics and ``/status`` read (gateway/metrics.py)."""
        return sidecar_snapshot(self)
