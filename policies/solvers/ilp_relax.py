"""The relaxation behind the ``ilp`` policy's proven bounds (:mod:`policies.solvers.ilp_bound`).

Written over classes c of GPUs (``n_c`` GPUs with the same cost coefficients, each reaching
``reach_cd,ch`` GPUs of class d over channel ch), in class totals: ``A_c`` the attention share
of the class, ``S_c`` the fraction of a layer's pairs it serves, ``K_c`` its replicas (native
form). Every row holds for the totals of any GPU-level placement: a phase costs its slowest
GPU, which is at least the class average; products of one GPU's share and another's served
fraction are summed over the pairs that talk over ch. Rows, per class and per block of MoE
layers (a block stands for ``weight`` layers; its constants are their averages, or their
worst case where a constant multiplies a variable)::

    sum_c A_c = 1,  A_lo_c <= A_c <= A_hi_c,  A_c <= n_c aU_c u_c   (u_c binary)      (r1)
    tauA_k >= (g_k + q) T A_c / n_c + o u_c,  tauA_k >= R_k u_c + q T A_c / n_c + o u_c (r2)
    sum_c S_c = 1,  S_c <= n_c xU_c,  S_c <= top(K_c)  (native),  S_c <= top(S n_c)   (r3)
    sum_c K_c >= E,  sum_c K_c <= E + R,  W + B sum_blocks K_c / n_c + M A_c / n_c <= U (r4)
    tauE >= f P S_c / n_c + o,  tauE >= (r K_c + b P S_c) / n_c + o,  tauE >= F          (r5)
    tauC >= alpha u_c,  tauC >= alpha A_c / (n_c aU_c) + V / bw * (volume of c over ch) / n_c (r6)

The volume a class sends over ch is ``sum_d (A_c S_d - pairs not joined by ch)``, where the
pairs not joined hold at most ``A_c m_cd xU_d`` and at most ``S_d m_dc aU_c`` (``m``: GPUs
not reached); what it receives is the same with A and S exchanged. ``A_c S_d`` is bounded
below by its McCormick envelope over the box ``[A_lo, A_hi] x [0, n_d xU_d]``, which the
branch and bound of :func:`policies.solvers.ilp_bound.global_bound` narrows. With the shares
fixed (every GPU of a class the same share) the volumes are linear and exact: one GPU of c
sends ``a_c sum_d frac_cd S_d`` and receives ``(S_c / n_c) sum_d reach_cd a_d``.

Under DeepEP's normal kernels (the ``forwarded`` exchange, prefill) a token crosses to a GPU
or a node once however many of its experts are there: every (r6) row is charged at
``1 / top_k`` of the pair volume and the RDMA receive rows are dropped
(:func:`_forwarded_floor`), so the rows stay lower bounds, weaker ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.estimate.costmodel import CostTable
from policies.hardware.topology import Channel
from policies.solvers.milp import Limits, MilpOutcome, Model

CHANNELS = (Channel.NVLINK, Channel.PCIE, Channel.RDMA, Channel.RDMA_CROSS)
"""Channels whose traffic the relaxation counts (LOCAL is free, UNREACHABLE unused)."""

Terms = list[tuple[int, float]]


@dataclass(frozen=True)
class ClassData:
    """One class of interchangeable GPUs.

    Attributes:
        members: GPU indices, fleet order.
        a_cap: the largest attention share one of its GPUs' memory allows.
        reach: ``reach[d][ch]``: GPUs of class d one of its GPUs reaches over channel ch.
    """

    members: tuple[int, ...]
    a_cap: float
    reach: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class Profile:
    """A block of MoE layers: the constants of rows (r3)-(r6).

    Attributes:
        weight: layers the block stands for.
        pairs: token-expert pairs per layer.
        cap: per class, the average over the block's layers of the most one GPU can serve
            (fraction of a layer's pairs).
        cap_worst: per class, the largest such cap over the block's layers.
        class_cap: engine form, per class: the average load of its ``S n_c`` heaviest experts.
        floor_us: average expert-phase floor (:func:`~policies.solvers.ilp_bound.expert_floor_us`).
        tangents: native form: ``(intercept, slope)`` lines above ``top(K)`` of every layer.
        top: ``top[k]``: the largest load of k experts over the block's layers (fraction).
    """

    weight: float
    pairs: float
    cap: tuple[float, ...]
    cap_worst: tuple[float, ...]
    class_cap: tuple[float, ...]
    floor_us: float
    tangents: tuple[tuple[float, float], ...]
    top: tuple[float, ...] = ()

    def top_of(self, k: int) -> float:
        """The largest load ``k`` experts carry in any of the block's layers (fraction)."""
        if not self.top:
            return 1.0
        return self.top[min(max(k, 0), len(self.top) - 1)]


class Relaxation:
    """Rows (r1)-(r6) for shares in the box ``[A_lo, A_hi]`` (class totals)."""

    def __init__(
        self,
        table: CostTable,
        classes: Sequence[ClassData],
        engine: bool,
        slots: int,
        budget: int,
        box: Sequence[tuple[float, float]],
        rule: str,
    ) -> None:
        self.table, self.classes, self.engine = table, classes, engine
        self.slots, self.budget, self.box, self.rule = slots, budget, box, rule
        self.fixed = all(lo == hi for lo, hi in box)
        m = self.m = Model("bound")
        self.objective: Terms = []
        self.A = [m.var(lo, hi) for lo, hi in box]
        self.u = []
        for c, (lo, hi) in enumerate(box):
            if lo > 0 or hi <= 0:  # decided by the box
                self.u.append(m.var(float(lo > 0), float(lo > 0)))
            else:
                self.u.append(m.var(0, 1, integer=True))
                m.le([(self.A[c], 1.0), (self.u[c], -classes[c].size * classes[c].a_cap)], 0.0)
        m.eq([(a, 1.0) for a in self.A], 1.0)  # (r1)
        self.K_blocks: list[tuple[float, list[int]]] = []

    def gpu(self, c: int) -> int:
        """A representative GPU of class c."""
        return self.classes[c].members[0]

    def attention(self) -> None:
        """(r2): the attention phase of each layer kind."""
        t, m, T = self.table, self.m, self.table.total_tokens
        for kind, count in (("moe", t.num_moe_layers), ("dense", t.num_dense_layers)):
            if not count:
                continue
            tau = m.var(0.0)
            self.objective.append((tau, float(count)))
            for c, cls in enumerate(self.classes):
                g = t.gpus[self.gpu(c)]
                core = g.attn_core_us_per_token * T / cls.size
                gemm = g.attn_gemm_us_per_token[kind] * T / cls.size
                over = g.attn_overhead_us
                m.ge([(tau, 1.0), (self.A[c], -(gemm + core)), (self.u[c], -over)], 0.0)
                read = g.attn_weight_read_us[kind]
                m.ge([(tau, 1.0), (self.u[c], -(read + over)), (self.A[c], -core)], 0.0)

    def block(self, p: Profile) -> None:
        """(r3)-(r6) of one block of layers."""
        t, m = self.table, self.m
        C = len(self.classes)
        S = [m.var(0.0, 1.0) for _ in range(C)]
        tau_e, tau_c = m.var(0.0), m.var(0.0)
        self.objective += [(tau_e, p.weight), (tau_c, p.weight)]
        m.eq([(s, 1.0) for s in S], 1.0)  # (r3)
        K = None if self.engine else self._replicas(S, p)
        o_min = min(t.gpus[self.gpu(c)].expert_overhead_us for c in range(C))
        for c, cls in enumerate(self.classes):
            g, n_c = t.gpus[self.gpu(c)], cls.size
            m.le([(S[c], 1.0)], n_c * p.cap[c])
            o = g.expert_overhead_us if self.engine else o_min  # (r5)
            f, b = (
                g.expert_flop_us_per_pair * p.pairs / n_c,
                g.expert_act_us_per_pair * p.pairs / n_c,
            )
            m.ge([(tau_e, 1.0), (S[c], -f)], o)
            if K is None:
                m.le([(S[c], 1.0)], p.class_cap[c])
                m.ge([(tau_e, 1.0), (S[c], -b)], o + g.expert_read_us_per_replica * self.slots)
            else:
                r = g.expert_read_us_per_replica / n_c
                m.ge([(tau_e, 1.0), (S[c], -b), (K[c], -r)], o)
        m.ge([(tau_e, 1.0)], p.floor_us)
        self._comm(tau_c, S, p)

    def _replicas(self, S: Sequence[int], p: Profile) -> list[int]:
        """Native form: the block's replicas per class, (r3)-(r4)."""
        m, E = self.m, self.table.num_experts
        K = [m.var(0.0, float(cls.size * E)) for cls in self.classes]
        m.ge([(k, 1.0) for k in K], float(E))
        m.le([(k, 1.0) for k in K], float(self.budget))
        for c, k in enumerate(K):
            for intercept, slope in p.tangents:
                m.le([(S[c], 1.0), (k, -slope)], intercept)
        self.K_blocks.append((p.weight, K))
        return K

    def memory(self) -> None:
        """(r4): native form, each class's replicas over all blocks fit next to its share."""
        t, m = self.table, self.m
        if self.engine or not self.K_blocks:
            return
        for c, cls in enumerate(self.classes):
            i = self.gpu(c)
            g = t.gpus[i]
            room = g.usable_bytes - g.fixed_bytes
            per_share = t.kv_cache_bytes(i, t.total_tokens) + t.total_tokens * t.act_bytes_per_token
            reps = [(K[c], w * t.expert_bytes / cls.size) for w, K in self.K_blocks]
            m.le([*reps, (self.A[c], per_share / cls.size)], room)
            const = t.kv_cache_bytes(i, 1e-9)  # prefill: the context's KV once it has a share
            if const > 0 and cls.a_cap > 0:
                act = t.total_tokens * t.act_bytes_per_token / cls.size
                m.le([*reps, (self.A[c], const / (cls.size * cls.a_cap) + act)], room)

    def _comm(self, tau_c: int, S: Sequence[int], p: Profile) -> None:
        """(r6): dispatch+combine of every class over every channel (or the all-gather)."""
        t, m = self.table, self.m
        V = t.total_tokens * t.top_k * t.bytes_per_copy
        for c, cls in enumerate(self.classes):
            g = t.gpus[self.gpu(c)]
            alpha = g.comm_alpha_us
            if self.rule == "allgather":
                self._gather(tau_c, c)
                continue
            m.ge([(tau_c, 1.0), (self.u[c], -alpha)], 0.0)
            busy: Terms = []  # alpha times the fraction of its GPUs that have attention
            base = 0.0
            if self.fixed:
                base = alpha if self.box[c][0] > 0 else 0.0
            elif cls.a_cap > 0:
                busy = [(self.A[c], -alpha / (cls.size * cls.a_cap))]
            for ch in CHANNELS:
                bw = g.comm_bw_bytes_per_us[ch]
                if bw <= 0 or not any(cls.reach[d][ch] for d in range(len(self.classes))):
                    continue
                coef = V / bw / cls.size
                volumes = self._any_rule(c, ch, S, p)
                if self.rule == "proportional":
                    volumes += [(self._send(c, ch, S, p), 0.0), (self._recv(c, ch, S, p), 0.0)]
                if t.exchange == "forwarded":
                    volumes, coef = _forwarded_floor(volumes, ch), coef / max(t.top_k, 1)
                for terms, const in volumes:
                    m.ge(
                        [(tau_c, 1.0), *busy, *((col, -coef * x) for col, x in terms)],
                        base + coef * const,
                    )

    def _gather(self, tau_c: int, c: int) -> None:
        """All-gather exchange: GPU i moves ``(1 - a_i)`` of the step's token bytes at the
        ring's bandwidth (:func:`policies.estimate.evaluation.gather_times_us`)."""
        t = self.table
        i = self.gpu(c)
        bw = float(t.gather_bw[i])
        if bw <= 0:
            return
        coef = t.total_tokens * t.bytes_per_copy / bw
        alpha = t.gpus[i].comm_alpha_us
        self.m.ge([(tau_c, 1.0), (self.A[c], coef / self.classes[c].size)], alpha + coef)

    def _any_rule(self, c: int, ch: int, S: Sequence[int], p: Profile) -> list[tuple[Terms, float]]:
        """Volumes over ch that hold whatever replica each token goes to (``(terms,
        constant)``, class totals): a GPU keeps at home at most its tokens of the experts
        held by the GPUs ch does not reach (``X``: their heaviest experts' load), and
        serves for those GPUs at most ``xU`` of their tokens."""
        C = len(self.classes)
        cls = self.classes[c]
        unreached = sum(self.classes[d].size - cls.reach[d][ch] for d in range(C))
        held = min(1.0, p.top_of(unreached * self._slots_each()))
        send: Terms = [(self.A[c], 1.0 - held)]
        home = [
            (self.A[d], -p.cap_worst[c] * (cls.size - self.classes[d].reach[c][ch]))
            for d in range(C)
            if cls.size - self.classes[d].reach[c][ch]
        ]
        recv: Terms = [(S[c], 1.0), *home]
        return [(send, 0.0), (recv, 0.0)]

    def _slots_each(self) -> int:
        """Most replicas one GPU holds in a layer (engine: its slots; native: every expert)."""
        return self.slots if self.engine else self.table.num_experts

    def _send(self, c: int, ch: int, S: Sequence[int], p: Profile) -> Terms:
        """Terms bounding below the pairs class c's GPUs send over ch (fraction of a
        layer's pairs, summed over the class)."""
        C = len(self.classes)
        cls = self.classes[c]
        if self.fixed:  # one GPU sends a_c * sum_d frac_cd S_d; n_c of them
            a = self.box[c][0] / cls.size
            return [
                (S[d], cls.size * a * cls.reach[d][ch] / self.classes[d].size)
                for d in range(C)
                if cls.reach[d][ch] and a > 0
            ]
        out: Terms = []
        for d in range(C):
            if cls.reach[d][ch]:
                out.append((self._pairs_term(c, d, ch, self.A[c], S[d], p, send=True), 1.0))
        return out

    def _recv(self, c: int, ch: int, S: Sequence[int], p: Profile) -> Terms:
        """As :meth:`_send`, for the pairs class c's GPUs receive over ch."""
        C = len(self.classes)
        cls = self.classes[c]
        if self.fixed:  # one GPU receives (S_c / n_c) sum_d reach_cd a_d; n_c of them
            A = sum(cls.reach[d][ch] * self.box[d][0] / self.classes[d].size for d in range(C))
            return [(S[c], A)] if A > 0 else []
        out: Terms = []
        for d in range(C):
            if cls.reach[d][ch]:
                out.append((self._pairs_term(c, d, ch, self.A[d], S[c], p, send=False), 1.0))
        return out

    def _pairs_term(
        self, c: int, d: int, ch: int, a_col: int, s_col: int, p: Profile, *, send: bool
    ) -> int:
        """A column w >= 0 bounding below the traffic between class c's GPUs and class d's
        over ch: ``A * S`` (McCormick over the box) less the pairs ch does not join."""
        m = self.m
        cls, other = self.classes[c], self.classes[d]
        a_owner = c if send else d  # whose attention share the product holds
        s_owner = d if send else c
        lo, hi = self.box[a_owner]
        s_hi = min(1.0, self.classes[s_owner].size * p.cap_worst[s_owner])
        m_cd = other.size - cls.reach[d][ch]  # GPUs of d one GPU of c does not reach
        m_dc = cls.size - other.reach[c][ch]
        a_cap = self.classes[a_owner].a_cap
        x_cap = p.cap_worst[s_owner]
        # pairs not joined, at most (per GPU of the A side) ... or (per GPU of the S side)
        if send:
            unjoined = [[(a_col, m_cd * x_cap)], [(s_col, m_dc * a_cap)]]
        else:
            unjoined = [[(s_col, m_cd * a_cap)], [(a_col, m_dc * x_cap)]]
        w = m.var(0.0)
        envelopes: list[tuple[Terms, float]] = [([(s_col, lo)], 0.0)]
        if s_hi > 0:
            envelopes.append(([(s_col, hi), (a_col, s_hi)], -hi * s_hi))
        for terms, const in envelopes:
            for less in unjoined:
                m.ge([(w, 1.0), *((k, -x) for k, x in terms), *less], const)
        return w

    def solve(self, solver: str, limits: Limits) -> MilpOutcome:
        """Minimise the step time over the rows built so far."""
        self.memory()
        self.m.minimise(self.objective)
        return self.m.solve(solver=solver, limits=limits)

    def shares(self, out: MilpOutcome) -> list[float] | None:
        """The class totals ``A_c`` of a solved relaxation, or None."""
        if not out.values:
            return None
        return [out.values[a] for a in self.A]


def reach_counts(
    table: CostTable, groups: Sequence[Sequence[int]]
) -> list[tuple[tuple[int, ...], ...]]:
    """``out[c][d][ch]``: GPUs of group d that the first GPU of group c reaches over ch."""
    out = []
    for g in groups:
        row = table.topology.channel[g[0]]
        out.append(
            tuple(
                tuple(sum(1 for j in h if row[j] == ch) for ch in range(len(Channel)))
                for h in groups
            )
        )
    return out


def _forwarded_floor(volumes: list[tuple[Terms, float]], ch: int) -> list[tuple[Terms, float]]:
    """The rows of :meth:`Relaxation._comm` that stay lower bounds under DeepEP's normal
    kernels (:mod:`policies.estimate.forwarding`), to be charged at ``1 / top_k`` of the
    pair volume: a token reaches a GPU or a node at most ``top_k`` times, so the tokens a GPU
    sends over a channel, and those it receives directly, are at least its pairs over
    ``top_k``; what a GPU receives over RDMA is what it forwards for its node, which its own
    pairs do not bound, so the receive rows of the RDMA channels are dropped (``volumes``
    alternate send, receive)."""
    if ch not in (Channel.RDMA, Channel.RDMA_CROSS):
        return volumes
    return volumes[0::2]
