"""qkv.analysis: rollout and flow (Abnar & Zuidema 2020) and head scores.

Rollout: a 2-layer example by hand, a path-sum twin, rows summing to 1, padding equal to the
truncated sequence, GQA, causal models. Flow: one layer is its weights, networkx and scipy
equal an Edmonds-Karp written here, flows stay under their capacities. Head scores: heads
built to attend to the previous token, the first token, themselves, everything, and a
2-layer induction circuit, each top of its score; bounded captures say the rows they used.
"""

import itertools
import math
import sys
from collections import deque

import fresh
import pytest
import torch
from torch import nn

import qkv
from qkv.analysis import flow, head_scores, induction_input, rollout

F64 = dict(dtype=torch.float64)


def random_maps(L, B, H, T, *, causal=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(L, B, H, T, T, generator=g, **F64) * 2
    if causal:
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return list(scores.softmax(-1))  # L x (B, H, T, T)


def augmented(A, residual=0.5):
    """The paper's mixing, plainly: (1 - r) A + r I, rows renormalised. (T, T) -> (T, T)."""
    A = (1 - residual) * A + residual * torch.eye(A.shape[-1], **F64)
    return A / A.sum(-1, keepdim=True)


# --- rollout -------------------------------------------------------------------------------


def test_rollout_two_layers_by_hand():
    """A1 = [[1, 0], [1/2, 1/2]], A2 = [[1/2, 1/2], [0, 1]]; with the residual at 1/2:
    Â1 = [[1, 0], [1/4, 3/4]], Â2 = [[3/4, 1/4], [0, 1]];
    R = Â2 Â1 = [[3/4 + 1/16, 3/16], [1/4, 3/4]] = [[13/16, 3/16], [4/16, 12/16]]."""
    A1 = torch.tensor([[1.0, 0.0], [0.5, 0.5]], **F64)
    A2 = torch.tensor([[0.5, 0.5], [0.0, 1.0]], **F64)
    R = rollout([A1[None, None], A2[None, None]])
    torch.testing.assert_close(R, torch.tensor([[[13, 3], [4, 12]]], **F64) / 16)
    # two heads averaging to the same maps give the same rollout; per head, each its own
    heads1 = torch.stack([torch.eye(2, **F64), 2 * A1 - torch.eye(2, **F64)])  # mean = A1
    heads2 = torch.stack([A2, A2])
    torch.testing.assert_close(rollout([heads1[None], heads2[None]]), R)
    per = rollout([heads1[None], heads2[None]], heads="per_head")  # (1, 2, 2, 2)
    torch.testing.assert_close(per[0, 0], augmented(A2) @ torch.eye(2, **F64))
    # residual 0: the plain product; residual 1: the identity
    torch.testing.assert_close(rollout([A1[None, None], A2[None, None]], residual=0.0)[0], A2 @ A1)
    torch.testing.assert_close(
        rollout([A1[None, None], A2[None, None]], residual=1.0)[0], torch.eye(2, **F64)
    )


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_rollout_equals_path_sum_and_rows_sum_to_1(causal):
    """The slow twin: R[j, i] = sum over every path i -> t1 -> ... -> j of the product of the
    mixed weights along it."""
    L, T = 3, 4
    maps = random_maps(L, 2, 3, T, causal=causal)
    R = rollout(maps, residual=0.3)  # (2, T, T)
    for b in range(2):
        aug = [augmented(A[b].mean(0), 0.3) for A in maps]
        slow = torch.zeros(T, T, **F64)
        for j, i in itertools.product(range(T), repeat=2):
            for mids in itertools.product(range(T), repeat=L - 1):
                path = (i, *mids, j)
                slow[j, i] += math.prod(float(aug[n][path[n + 1], path[n]]) for n in range(L))
        torch.testing.assert_close(R[b], slow)
    torch.testing.assert_close(R.sum(-1), torch.ones(2, T, **F64))
    if causal:
        assert (R.triu(1) == 0).all()


class Blocks(nn.Module):
    """Residual qkv.MultiHeadAttention blocks that take a key_mask."""

    def __init__(self, layers=2, C=16, H=4, **kw):
        super().__init__()
        self.blocks = nn.ModuleList(qkv.MultiHeadAttention(C, H, **kw) for _ in range(layers))

    def forward(self, x, *, key_mask=None, is_causal=False):
        for blk in self.blocks:
            x = x + blk(x, key_mask=key_mask, is_causal=is_causal)  # (B, T, C)
        return x


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_padding_equals_the_truncated_sequence(causal):
    """Right padding masked by key_mask: the real tokens' rollout and flow are those of the
    sequence without its padding; padded rows and columns are 0."""
    torch.manual_seed(0)
    model = Blocks(**F64).eval()
    x = torch.randn(2, 7, 16, **F64)
    lengths = [7, 4]
    key_mask = torch.arange(7) < torch.tensor(lengths)[:, None]  # (2, 7)
    with qkv.capture(model) as cap:
        model(x, key_mask=key_mask, is_causal=causal)
    R = rollout(cap, key_mask=key_mask)  # (2, 7, 7)
    Fl = flow(cap, key_mask=key_mask)
    for b, n in enumerate(lengths):
        with qkv.capture(model) as alone:
            model(x[b : b + 1, :n], is_causal=causal)
        torch.testing.assert_close(R[b, :n, :n], rollout(alone)[0])
        torch.testing.assert_close(Fl[b, :n, :n], flow(alone)[0])
        assert (R[b, n:] == 0).all() and (R[b, :, n:] == 0).all() and (Fl[b, n:] == 0).all()
        torch.testing.assert_close(R[b, :n].sum(-1), torch.ones(n, **F64))
    torch.testing.assert_close(rollout([r.probs for r in cap.records], key_mask=key_mask), R)


def test_weights_on_padded_keys_are_renormalised_away():
    """A model that did not mask its padding: weight on padded key 2 is dropped and the row
    renormalised, [1/2, 1/4, 1/4] -> [2/3, 1/3, 0], before the residual is mixed in."""
    A = torch.tensor([[1.0, 0, 0], [0.5, 0.25, 0.25], [0.2, 0.3, 0.5]], **F64)
    R = rollout([A[None, None]], key_mask=torch.tensor([[True, True, False]]))
    torch.testing.assert_close(R[0], torch.tensor([[1, 0, 0], [1 / 3, 2 / 3, 0], [0, 0, 0]], **F64))


def test_gqa_capture():
    """A GQA model (4 query heads over 2 key/value heads): the capture keeps weights per query
    head; rollout of it equals rollout of the modules' own traces, per head too, and a capture
    bounded to heads [1, 3] averages those two."""
    torch.manual_seed(1)
    model = Blocks(layers=3, num_kv_heads=2, **F64).eval()
    x = torch.randn(2, 6, 16, **F64)
    with qkv.capture(model) as cap:
        model(x, is_causal=True)
    traces = [r.probs for r in cap.records]
    assert traces[0].shape == (2, 4, 6, 6)
    torch.testing.assert_close(rollout(cap), rollout(traces))
    assert rollout(cap, heads="per_head").shape == (2, 4, 6, 6)
    with qkv.capture(model, heads=[1, 3]) as part:
        model(x, is_causal=True)
    torch.testing.assert_close(rollout(part), rollout([t[:, [1, 3]] for t in traces]))


def test_decoder_lm_capture():
    model = qkv.DecoderLM(23, 16, 4, 3, max_len=32).eval()
    with qkv.capture(model) as cap:
        model(torch.randint(23, (2, 9)))
    R = rollout(cap)
    assert R.shape == (2, 9, 9) and R.dtype == torch.float32
    torch.testing.assert_close(R.sum(-1), torch.ones(2, 9))
    assert (R.triu(1) == 0).all()
    Fl = flow(cap, positions=[-1], solver="scipy")  # (2, 1, 9): the last token's saliency
    assert Fl.shape == (2, 1, 9)
    torch.testing.assert_close(Fl.sum(-1), torch.ones(2, 1))


def test_bounded_rows_and_cross_attention_refused():
    model = Blocks().eval()
    x = torch.randn(1, 5, 16)
    with qkv.capture(model, rows=[-1]) as cap:
        model(x)
    with pytest.raises(ValueError, match="rows=None"):
        rollout(cap)
    cross = torch.full((1, 1, 3, 5), 0.2)
    with pytest.raises(ValueError, match="self-attention"):
        rollout([cross])
    with pytest.raises(ValueError, match="residual"):
        rollout(random_maps(1, 1, 1, 3), residual=1.5)
    with pytest.raises(ValueError, match="per_head"):
        rollout(random_maps(1, 1, 2, 3) + random_maps(1, 1, 3, 3), heads="per_head")
    with pytest.raises(ValueError, match="positions"):
        flow(random_maps(1, 1, 1, 3), positions=[3])
    with pytest.raises(ValueError, match="solver"):
        flow(random_maps(1, 1, 1, 3), solver="lp")


# --- flow ----------------------------------------------------------------------------------


def edmonds_karp(cap: dict, s, t) -> float:
    """The slow twin: shortest augmenting paths on a dict {(u, v): capacity}."""
    res = dict(cap)
    for u, v in cap:
        res.setdefault((v, u), 0.0)
    nbrs = {}
    for u, v in res:
        nbrs.setdefault(u, []).append(v)
    total = 0.0
    while True:
        parent, queue = {s: None}, deque([s])
        while queue and t not in parent:
            u = queue.popleft()
            for v in nbrs.get(u, []):
                if v not in parent and res[u, v] > 1e-15:
                    parent[v] = u
                    queue.append(v)
        if t not in parent:
            return total
        path, v = [], t
        while parent[v] is not None:
            path.append((parent[v], v))
            v = parent[v]
        push = min(res[e] for e in path)
        for u, v in path:
            res[u, v] -= push
            res[v, u] += push
        total += push


def slow_flows(maps, residual=0.5):
    """Every (output j, input i) max-flow of head-mean maps of batch element 0."""
    aug = [augmented(A[0].mean(0), residual) for A in maps]
    L, T = len(aug), aug[0].shape[-1]
    cap = {
        ((n, i), (n + 1, j)): float(aug[n][j, i])
        for n in range(L)
        for j in range(T)
        for i in range(T)
        if aug[n][j, i] > 0
    }
    return torch.tensor(
        [[edmonds_karp(cap, (0, i), (L, j)) for i in range(T)] for j in range(T)], **F64
    ), aug


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_flow_equals_edmonds_karp_twin_and_stays_under_capacity(causal):
    maps = random_maps(3, 1, 2, 5, causal=causal, seed=3)
    slow, aug = slow_flows(maps)
    nx_flow = flow(maps, normalize=False)[0]  # (T, T)
    torch.testing.assert_close(nx_flow, slow)
    edges = sum(int((A > 0).sum()) for A in aug)
    sp_flow = flow(maps, normalize=False, solver="scipy")[0]
    assert (sp_flow - slow).abs().max() <= edges * 2.0**-25  # the rounding bound stated
    out_of_source = aug[0].sum(0)  # (T,): capacity leaving input i
    assert (nx_flow <= out_of_source[None, :] + 1e-12).all()
    assert (nx_flow <= 1 + 1e-12).all()  # capacity into an output: its row of Â_L, 1
    normalized = flow(maps)[0]
    torch.testing.assert_close(normalized, slow / slow.sum(-1, keepdim=True))
    part = flow(maps, positions=[-1, 0], heads="per_head", normalize=False)
    assert part.shape == (1, 2, 2, 5)
    if causal:
        assert (nx_flow.triu(1) == 0).all()


def test_flow_of_one_layer_is_its_weights():
    """One layer: each input reaches each output by one edge, so the flow is that edge's
    capacity: the mixed weights themselves (as is the rollout)."""
    maps = random_maps(1, 2, 3, 4)
    torch.testing.assert_close(flow(maps, normalize=False), rollout(maps))


def test_flow_says_which_extra_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "networkx", None)
    with pytest.raises(ImportError, match=r"qkv\[analysis\]"):
        flow(random_maps(1, 1, 1, 3))


def test_import_qkv_loads_no_graph_library():
    code = (
        "import sys, qkv; qkv.analysis.rollout; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'networkx', 'scipy'}))"
    )
    out = fresh.run(code, check=True)  # a fresh interpreter: this one imported everything
    assert out.stdout.strip() == "[]"


# --- head scores ---------------------------------------------------------------------------


class Positional(nn.Module):
    """One causal qkv.MultiHeadAttention over one-hot positions, its 4 heads forced by hand:
    0 the previous token, 1 the first token, 2 itself, 3 everything (zero scores)."""

    def __init__(self, T=12, D=16, sharp=200.0):
        super().__init__()
        self.T = T
        self.mha = qkv.MultiHeadAttention(4 * D, 4, bias=False, **F64)
        w_q, w_k, w_v = torch.zeros(3, 4 * D, 4 * D, **F64)  # (out, in) each
        for t in range(T):
            w_q[0 * D + t, t] = sharp  # head 0: q_t = e_t, k_s = e_{s+1}
            if t + 1 < D:
                w_k[0 * D + t + 1, t] = 1
            w_q[1 * D + 0, t] = sharp  # head 1: q_t = e_0, k_s = e_0 only for s = 0
            w_q[2 * D + t, t] = sharp  # head 2: q_t = e_t, k_s = e_s
            w_k[2 * D + t, t] = 1
        w_k[1 * D + 0, 0] = 1
        w_v[:] = torch.eye(4 * D, **F64)
        with torch.no_grad():
            self.mha.in_proj_weight.copy_(torch.cat([w_q, w_k, w_v]))

    def forward(self, batch=2):
        x = torch.eye(self.T, self.mha.embed_dim, **F64).expand(batch, -1, -1)  # (B, T, C)
        return self.mha(x, is_causal=True)


def test_heads_built_for_a_score_score_highest():
    model = Positional()
    with qkv.capture(model) as cap:
        model()
    table = head_scores(cap)
    assert table.keys == ((0, 0), (0, 1), (0, 2), (0, 3))
    assert table.top("previous_token") == [(0, 0)]
    assert table.top("first_token") == [(0, 1)]
    assert table.top("self") == [(0, 2)]
    assert table.top("entropy") == [(0, 3)]
    assert table[0, 0]["previous_token"] > 0.99 and table[0, 1]["first_token"] > 0.99
    assert table[0, 0]["local"] > 0.99 > table[0, 1]["local"]
    # the uniform head's entropy is the mean of log(q + 1) over rows 0..11, in nats
    assert table[0, 3]["entropy"] == pytest.approx(sum(math.log(q + 1) for q in range(12)) / 12)
    assert math.isnan(table[0, 0]["induction"])  # no induction input given
    assert table.sorted_by("self").keys[0] == (0, 2)
    rows = table.to_rows()
    assert rows[1]["layer"] == 0 and rows[1]["head"] == 1 and "entropy" in rows[1]
    assert "previous_token 1..11" in str(table) and "self 0..11" in str(table)


class Induction(nn.Module):
    """Two causal one-head qkv.MultiHeadAttention layers wired as an induction circuit.

    The residual stream holds [token one-hot (V) | position one-hot (T) | previous token (V)].
    Layer 0 attends to the previous position and writes that token into the third part;
    layer 1's query is the current token and its keys the previous-token part, so it attends
    to the position right after an earlier occurrence of the current token.
    """

    def __init__(self, V=12, T=13, sharp=200.0):
        super().__init__()
        self.V, self.T = V, T
        C = 2 * V + T
        tok, pos, prev = slice(0, V), slice(V, V + T), slice(V + T, C)
        self.layers = nn.ModuleList(
            qkv.MultiHeadAttention(C, 1, bias=False, **F64) for _ in range(2)
        )
        w = torch.zeros(2, 4, C, C, **F64)  # (layer, q/k/v/o, out, in)
        for t in range(T):
            w[0, 0, V + t, V + t] = sharp  # layer 0: q_t = e_t, k_s = e_{s+1}: previous token
            if t + 1 < T:
                w[0, 1, V + t + 1, V + t] = 1
        w[0, 2][tok, tok] = torch.eye(V, **F64)  # v = the token
        w[0, 3][prev, tok] = torch.eye(V, **F64)  # out: into the previous-token part
        w[1, 0][tok, tok] = sharp * torch.eye(V, **F64)  # layer 1: q = token
        w[1, 1][tok, prev] = torch.eye(V, **F64)  # k = previous token
        del pos
        with torch.no_grad():
            for layer, m in zip(w, self.layers):
                m.in_proj_weight.copy_(torch.cat([layer[0], layer[1], layer[2]]))
                m.out_proj.weight.copy_(layer[3])

    def forward(self, tokens):
        B, T = tokens.shape
        x = torch.cat(
            [
                nn.functional.one_hot(tokens, self.V).double(),
                torch.eye(T, **F64).expand(B, -1, -1),
                torch.zeros(B, T, self.V, **F64),
            ],
            -1,
        )  # (B, T, C)
        for m in self.layers:
            x = x + m(x, is_causal=True)
        return x


def test_induction_circuit_scores_highest_on_induction():
    ind = induction_input(12, 6, batch=3, bos=11, seed=5)
    assert ind.tokens.shape == (3, 13) and ind.start == 1 and ind.period == 6
    assert (ind.tokens[:, 0] == 11).all()
    assert torch.equal(ind.tokens[:, 1:7], ind.tokens[:, 7:13])
    model = Induction()
    with qkv.capture(model) as cap:
        model(ind.tokens)
    table = head_scores(cap, induction=ind)
    assert table.top("induction") == [(1, 0)] and table.top("previous_token") == [(0, 0)]
    assert table[1, 0]["induction"] > 0.99 and table[0, 0]["induction"] < 0.01
    assert table.rows_used(1, "induction").tolist() == list(range(7, 13))


def test_bounded_capture_reports_rows_used():
    model = Positional()
    with qkv.capture(model) as full:
        model()
    with qkv.capture(model, heads=[0, 3], rows=[0, 5, 6, 11]) as cap:
        model()
    table = head_scores(cap, induction=4)
    assert table.keys == ((0, 0), (0, 3))
    assert table.rows_used(0, "previous_token").tolist() == [5, 6, 11]
    assert table.rows_used(0, "self").tolist() == [0, 5, 6, 11]
    assert table.rows_used(0, "induction").tolist() == [5, 6, 11]  # q >= period 4
    p = full.records[0].probs[:, 3]  # (B, T, S): head 3, every row
    expect = sum(float(p[:, q, q - 1].mean()) for q in (5, 6, 11)) / 3
    assert table[0, 3]["previous_token"] == pytest.approx(expect)
    assert "[5, 6, 11]" in str(table) or "5, 6, 11" in str(table)
    with qkv.capture(model, rows=[0]) as first:
        model()
    assert math.isnan(head_scores(first)[0, 0]["previous_token"])  # row 0 has no previous


def test_head_scores_leave_padded_rows_out():
    torch.manual_seed(0)
    model = Blocks(**F64).eval()
    key_mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    x = torch.randn(2, 6, 16, **F64)
    with qkv.capture(model) as cap:
        model(x, key_mask=key_mask, is_causal=True)
    table = head_scores(cap, key_mask=key_mask)
    assert table.rows_used(0, "self").tolist() == list(range(6))  # row 5 real in element 0
    with qkv.capture(model) as short:
        model(x[1:, :3], is_causal=True)
    with qkv.capture(model, batch=[1]) as one:
        model(x, key_mask=key_mask, is_causal=True)
    torch.testing.assert_close(
        head_scores(one, key_mask=key_mask).values, head_scores(short).values, equal_nan=True
    )
