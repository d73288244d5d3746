"""Deep Gradient Compression: schedule, selection, the optimizer and the DDP hook, on real gloo
process groups (several processes on 127.0.0.1, short timeouts)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt.compat import paddle
from scaleopt.dgc import (DGCHookState, DGCMomentum, PAPER_SPARSITY, k_of, sparsity_at, topk_exact,
                          topk_sampled)

import dgc_workers as W
from oracle import case_files, load, make_params, replay

# -- schedule and selection ---------------------------------------------------------------------


def test_paddle_sparsity_schedule():
    s = [0.75, 0.9375, 0.984375, 0.996, 0.999]
    assert [sparsity_at(t, 3, 10, s) for t in range(0, 16)] == [
        None, None, None,  # dense before rampup_begin_step
        0.75, 0.75, 0.9375, 0.9375, 0.984375, 0.984375, 0.996, 0.996, 0.999, 0.999,
        0.999, 0.999, 0.999]
    assert sparsity_at(0, 0, 1, [0.999]) == 0.999
    assert PAPER_SPARSITY == (0.75, 0.9375, 0.984375, 0.996, 0.999)


@pytest.mark.parametrize("n, s, k", [(1000, 0.999, 1), (100000, 0.999, 100), (10, 0.0, 10),
                                     (7, 0.5, 4), (1, 0.999, 1), (0, 0.9, 0)])
def test_k_is_ceil_of_density_times_numel(n, s, k):
    assert k_of(n, s) == k


@pytest.mark.parametrize("n, k", [(100000, 100), (50000, 1), (20000, 2000), (300, 299), (64, 64)])
def test_sampled_selection_is_the_exact_top_k(n, k):
    g = torch.Generator().manual_seed(n + k)
    v = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3  # heavy-ish tails
    got = topk_sampled(v, k, generator=g)
    assert got.numel() == k and got.unique().numel() == k
    assert set(got.tolist()) == set(topk_exact(v, k).tolist())


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4099])
def test_the_candidates_above_a_threshold_are_every_such_index_in_order(n):
    """The C pass that collects |v| >= threshold tests blocks of 64 first: partial blocks at the
    end, hits at block edges, a capacity too small (the count still exact)."""
    from scaleopt import _native

    g = torch.Generator().manual_seed(n)
    v = torch.randn(n, generator=g)
    v[::64] = 5.0  # a hit at the start of every block
    v[-1] = -6.0  # and at the very end
    want = (v.abs() >= 2.0).nonzero().flatten()
    assert torch.equal(_native.select_above(v, 2.0, n), want)
    assert _native.select_above(v, 2.0, want.numel() - 1) is None  # more than the capacity


def test_sampled_selection_survives_a_bad_sample():
    v = torch.zeros(100000)
    v[:50] = torch.arange(1, 51, dtype=torch.float32)  # almost every sample sees 0
    got = topk_sampled(v, 50, generator=torch.Generator().manual_seed(0))
    assert sorted(got.tolist()) == list(range(50))


# -- one process ------------------------------------------------------------------------------------


def _train_pair(make_a, make_b, steps=6, seed=0):
    a = W.model_of(seed)
    b = copy.deepcopy(a)
    oa, ob = make_a(a), make_b(b)
    for t in range(steps):
        x, y = W.batch(0, t)
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            (model(x) - y).square().mean().backward()
            opt.step()
    return a, b, oa, ob


@pytest.mark.parametrize("nesterov", [False, True])
def test_density_one_without_masking_is_momentum_sgd(nesterov):
    a, b, *_ = _train_pair(
        lambda m: DGCMomentum(m.parameters(), lr=0.05, sparsity=[0.0], min_numel=1,
                              momentum_masking=False, nesterov=nesterov),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov))
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_before_rampup_it_is_paddle_momentum_on_the_golden_cases():
    for path in case_files(["paddle_momentum"]):
        case = load(path)
        params = make_params(case)
        hp = case["normalized"]
        opt = DGCMomentum(list(params.values()), lr=hp["lr"], momentum=hp["momentum"],
                          nesterov=hp.get("nesterov", False), rampup_begin_step=10 ** 6)
        replay(case, params, opt.step)


def test_conservation_in_one_process():
    opts = dict(lr=0.05, momentum=0.9, sparsity=[0.95], min_numel=100, selection="sample")
    model = W.model_of()
    w0 = [p.detach().clone() for p in model.parameters()]
    opt = DGCMomentum(model.parameters(), **opts)
    u_sum = [torch.zeros_like(p) for p in model.parameters()]
    for t in range(8):
        W.step_adding_up_u(model, opt, u_sum, 0.9, 0, t)
    for p, p0, s in zip(model.parameters(), w0, u_sum):
        applied = (p0 - p.detach()) / 0.05
        if p.numel() >= 100:
            # everything accumulated was either applied or is still in the residual v
            torch.testing.assert_close(applied + opt.state[p]["v"], s, rtol=1e-4, atol=1e-5)
            assert opt.state[p]["v"].abs().sum() > 0  # and something is still held back


def test_telemetry_counts_exactly_k_pairs():
    model = W.model_of()
    opt = DGCMomentum(model.parameters(), lr=0.1, sparsity=[0.999], min_numel=4096)
    x, y = W.batch(0, 0)
    (model(x) - y).square().mean().backward()
    opt.step()
    big = [p.numel() for p in model.parameters() if p.numel() >= 4096]
    ks = [k_of(n, 0.999) for n in big]
    assert opt.telemetry["bytes_gathered"] == sum(ks) * (4 + 4)  # world 1: int32 + float32
    small = sum(p.numel() for p in model.parameters() if p.numel() < 4096)
    assert opt.telemetry["selected"] == sum(ks) + small
    # this rank's message: its pairs, and the small tensors' values, against the gradient's bytes
    assert opt.telemetry["payload_bytes"] == sum(ks) * (4 + 4) + small * 4
    assert opt.telemetry["dense_payload_bytes"] == sum(p.numel() for p in model.parameters()) * 4


def test_parameters_without_gradients_and_k_at_least_numel():
    model = W.model_of()
    idle = nn.Parameter(torch.randn(10))
    opt = DGCMomentum(list(model.parameters()) + [idle], lr=0.1, sparsity=[0.0], min_numel=1)
    before = idle.detach().clone()
    x, y = W.batch(0, 0)
    (model(x) - y).square().mean().backward()
    opt.step()
    assert torch.equal(before, idle) and len(opt.state[idle]) == 0
    for p in model.parameters():  # density 1: everything was sent, nothing held back
        assert opt.state[p]["v"].abs().max() == 0


def test_skip_is_agreed_over_the_workers(tmp_path):
    """A NaN in one worker's gradient under nonfinite="skip": every worker skips the step
    (residuals and weights untouched), and the replicas stay equal and finite."""
    for result in W.run_workers(W.skip_on_one_rank, 2, tmp_path, timeout=120):
        assert result == (1, True, True, True)


def test_resume_is_bit_identical_and_a_new_world_size_resets_the_residuals():
    def make(m):
        return DGCMomentum(m.parameters(), lr=0.05, sparsity=[0.9, 0.99], rampup_begin_step=1,
                           rampup_step=3, min_numel=1000)
    a = W.model_of()
    oa = make(a)
    for t in range(3):
        x, y = W.batch(0, t)
        oa.zero_grad(); (a(x) - y).square().mean().backward(); oa.step()
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b = copy.deepcopy(a)
    ob = make(b)
    ob.load_state_dict(copy.deepcopy(saved))
    assert ob.dgc_step == 3
    for t in range(3, 7):
        x, y = W.batch(0, t)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad(); (m(x) - y).square().mean().backward(); o.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    saved["world_size"] = 4
    c = copy.deepcopy(a)
    oc = make(c)
    with pytest.warns(UserWarning, match="reset"):
        oc.load_state_dict(saved)
    assert all(st["v"].abs().max() == 0 for st in oc.state.values())


@pytest.mark.parametrize("kwargs, error", [
    (dict(lr=-1.0), ValueError), (dict(momentum=1.0), ValueError),
    (dict(sparsity=[1.0]), ValueError), (dict(sparsity=[]), TypeError),
    (dict(sparsity=0.99), TypeError), (dict(rampup_step=0), ValueError),
    (dict(rampup_begin_step=-1), ValueError), (dict(min_numel=1.5), ValueError),
    (dict(local_grad_clip_norm=0.0), ValueError), (dict(selection="random"), ValueError),
    (dict(weight_decay_mode="l3"), ValueError), (dict(clip_mode="layer"), ValueError),
    (dict(value_dtype=torch.int16), ValueError), (dict(nesterov=True, momentum=0.0), ValueError),
])
def test_bad_options_are_clear_errors(kwargs, error):
    opts = dict(lr=0.1)
    opts.update(kwargs)
    with pytest.raises(error):
        DGCMomentum([nn.Parameter(torch.randn(3))], **opts)


# -- several processes --------------------------------------------------------------------------


def _simulate(world, steps, opts):
    """An independent single-process reference of N DGC workers with exact top-k."""
    models = [W.model_of() for _ in range(world)]
    params = [list(m.parameters()) for m in models]
    n = len(params[0])
    u = [[torch.zeros_like(p) for p in params[0]] for _ in range(world)]
    v = [[torch.zeros_like(p) for p in params[0]] for _ in range(world)]
    out = []
    m, lr = opts["momentum"], opts["lr"]
    for t in range(steps):
        grads = []
        for r in range(world):
            for p in params[r]:
                p.grad = None
            x, y = W.batch(r, t)
            (models[r](x) - y).square().mean().backward()
            grads.append([p.grad.clone() for p in params[r]])
        s = sparsity_at(t, opts["rampup_begin_step"], opts["rampup_step"], opts["sparsity"])
        for i in range(n):
            numel = params[0][i].numel()
            k = numel if s is None else k_of(numel, s)
            dense = s is None or numel < opts["min_numel"] or \
                (world - 1) * k * 8 >= 2 * (world - 1) / world * numel * 4
            if dense:
                gbar = sum(grads[r][i] for r in range(world)) / world
                for r in range(world):
                    u[r][i] = m * u[r][i] + gbar
                    with torch.no_grad():
                        params[r][i] -= lr * u[r][i]
                continue
            total = torch.zeros(numel)
            for r in range(world):
                u[r][i] = m * u[r][i] + grads[r][i]
                v[r][i] = v[r][i] + u[r][i]
                flat = v[r][i].reshape(-1)
                idx = torch.topk(flat.abs(), k).indices
                total.index_add_(0, idx, flat[idx])
                flat[idx] = 0
                u[r][i].reshape(-1)[idx] = 0
            for r in range(world):
                with torch.no_grad():
                    params[r][i] -= lr * (total / world).view_as(params[r][i])
        out.append(torch.cat([p.detach().reshape(-1) for p in params[0]]))
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_n_processes_equal_the_simulation_and_stay_identical(world, tmp_path):
    steps = 5
    opts = dict(W.OPTIONS)
    results = W.run_workers(W.train_dgc, world, tmp_path, steps, opts)
    want = _simulate(world, steps, opts)
    for t in range(steps):
        replicas = results[0]["history"][t]
        for r in range(1, world):
            assert torch.equal(replicas[0], replicas[r]), f"rank {r} differs at step {t}"
        torch.testing.assert_close(replicas[0], want[t], rtol=1e-5, atol=1e-6)
    # exactly k (index, value) pairs per compressed tensor from every rank
    tel = results[0]["telemetry"][-1]
    s = opts["sparsity"][-1]
    ks = [k_of(n, s) for n in results[0]["numels"] if n >= opts["min_numel"]]
    assert tel["bytes_gathered"] == world * sum(ks) * (4 + 4)
    assert tel["bytes_sent"] < tel["dense_bytes"]


def test_conservation_across_processes(tmp_path):
    world, steps = 2, 6
    opts = dict(lr=0.05, momentum=0.9, sparsity=[0.95], min_numel=4096, selection="sample")
    results = W.run_workers(W.train_dgc, world, tmp_path, steps, opts)
    w0 = torch.cat([p.detach().reshape(-1) for p in W.model_of().parameters()])
    applied = (w0 - results[0]["history"][-1][0]) / opts["lr"]  # = sum_t G_t, G the mean
    at = 0
    for i, numel in enumerate(results[0]["numels"]):
        if numel >= opts["min_numel"]:
            sent_by_all = world * applied[at:at + numel]
            residuals = sum(r["v"][i].reshape(-1) for r in results)
            accumulated = sum(r["u_sum"][i].reshape(-1) for r in results)
            torch.testing.assert_close(sent_by_all + residuals, accumulated, rtol=1e-4, atol=1e-4)
        at += numel


@pytest.mark.parametrize("bucket_cap_mb", [25.0, pytest.param(0.01, marks=pytest.mark.slow)])
def test_the_ddp_hook_equals_the_optimizer(bucket_cap_mb, tmp_path):
    world, steps = 2, 5
    opts = dict(W.OPTIONS)
    a = W.run_workers(W.train_dgc, world, tmp_path / "opt", steps, opts)
    b = W.run_workers(W.train_hook, world, tmp_path / "hook", steps, opts, bucket_cap_mb)
    for t in range(steps):
        torch.testing.assert_close(b[0]["history"][t], a[0]["history"][t][0], rtol=1e-5, atol=1e-6)
    assert b[0]["telemetry"]["bytes_gathered"] == a[0]["telemetry"][-1]["bytes_gathered"]


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_a_parameter_used_on_one_rank_only(tmp_path):
    # rank 1 never touches the branch: it must still take part (as with a zero gradient) rather
    # than send a different set of tensors and hang or mix up the buffers
    world, steps = 2, 4
    opts = dict(lr=0.05, momentum=0.9, sparsity=[0.9], min_numel=1, selection="topk")
    unused = W.run_workers(W.train_with_a_branch_only_rank_0_uses, world, tmp_path / "a", steps,
                           opts, False)
    zeros = W.run_workers(W.train_with_a_branch_only_rank_0_uses, world, tmp_path / "b", steps,
                          opts, True)
    for t in range(steps):
        a, b = unused[0]["history"][t], zeros[0]["history"][t]
        assert torch.equal(a[0], a[1]), f"replicas differ at step {t}"
        assert torch.equal(a[0], b[0])  # = rank 1 sending a zero gradient for the branch
    assert not torch.equal(unused[0]["history"][-1][0][-20:], unused[0]["history"][0][0][-20:])


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_the_ddp_hook_with_unused_parameters_equals_the_optimizer(tmp_path):
    # DDP(find_unused_parameters=True) hands the hook zeros for the branch rank 1 does not run;
    # the result equals the optimizer path, where rank 1 takes part with a zero gradient
    world, steps = 2, 4
    opts = dict(lr=0.05, momentum=0.9, sparsity=[0.9], min_numel=1, selection="topk")
    a = W.run_workers(W.train_with_a_branch_only_rank_0_uses, world, tmp_path / "opt", steps,
                      opts, False)
    b = W.run_workers(W.train_hook_with_a_branch_only_rank_0_uses, world, tmp_path / "hook",
                      steps, opts)
    for t in range(steps):
        assert torch.equal(b[0]["history"][t][0], b[0]["history"][t][1])
        torch.testing.assert_close(b[0]["history"][t][0], a[0]["history"][t][0], rtol=1e-5,
                                   atol=1e-6)


def test_a_dead_rank_is_a_clear_error_not_a_hang(tmp_path):
    results = W.run_workers(W.die_after_one_step, 2, tmp_path, timeout=60)
    assert results[0]["error"] and "peer rank may have died" in results[0]["error"]
    assert results[0]["after_s"] < 30


def test_hook_state_pickles_without_model_and_group():
    import pickle

    model = W.model_of()
    state = scaleopt.dgc.DGCHookState(model, sparsity=[0.99])
    state.residuals["0.weight"] = {"u": torch.ones(2), "v": torch.zeros(2)}
    back = pickle.loads(pickle.dumps(state))
    assert back.model is None and back.process_group is None
    assert torch.equal(back.residuals["0.weight"]["u"], torch.ones(2))
    with pytest.raises(RuntimeError, match="attach"):
        back.name_of(next(model.parameters()))
    assert back.attach(model).name_of(next(model.parameters())) == "0.weight"


# -- Paddle front-end ---------------------------------------------------------------------------


def test_paddle_dgc_momentum_optimizer_arguments():
    model = W.model_of()
    opt = paddle.DGCMomentumOptimizer(
        learning_rate=0.01, momentum=0.9, rampup_begin_step=2, rampup_step=3,
        sparsity=[0.99], parameters=model.parameters(), local_grad_clip_norm=1.0,
        regularization=paddle.L2Decay(1e-4), grad_clip=paddle.ClipGradByNorm(1.0))
    g = opt.param_groups[0]
    assert (g["lr"], g["momentum"], g["rampup_begin_step"], g["rampup_step"]) == (0.01, 0.9, 2, 3)
    assert g["weight_decay"] == 1e-4 and g["weight_decay_mode"] == "l2"
    assert g["local_grad_clip_norm"] == 1.0 and g["clip_mode"] == "tensor"
    x, y = W.batch(0, 0)
    (model(x) - y).square().mean().backward()
    opt.step()
    opt.clear_grad()  # Paddle's default: set to zero
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    l1 = paddle.DGCMomentumOptimizer(0.01, 0.9, 0, parameters=model.parameters(),
                                     regularization=paddle.L1Decay(1e-3))
    assert l1.param_groups[0]["weight_decay_mode"] == "l1"


@pytest.mark.parametrize("clip", ["global", "value"])
def test_paddle_dgc_rejects_other_clips(clip):
    c = paddle.ClipGradByGlobalNorm(1.0) if clip == "global" else paddle.ClipGradByValue(1.0)
    with pytest.raises(TypeError, match="ClipGradByNorm"):
        paddle.DGCMomentumOptimizer(0.01, 0.9, 0, parameters=W.model_of().parameters(), grad_clip=c)


def test_half_precision_values_halve_the_value_bytes_and_keep_the_rounding_error():
    model = W.model_of()
    opt = DGCMomentum(model.parameters(), lr=0.1, sparsity=[0.99], min_numel=4096,
                      value_dtype=torch.float16)
    x, y = W.batch(0, 0)
    (model(x) - y).square().mean().backward()
    u0 = [p.grad.clone() for p in model.parameters()]  # first step: u = g, v = u
    w0 = [p.detach().clone() for p in model.parameters()]
    opt.step()
    ks = [k_of(p.numel(), 0.99) for p in model.parameters() if p.numel() >= 4096]
    assert opt.telemetry["bytes_gathered"] == sum(ks) * (4 + 2)
    small = sum(p.numel() for p in model.parameters() if p.numel() < 4096)
    assert opt.telemetry["payload_bytes"] == sum(ks) * (4 + 2) + small * 4  # dense stay float32
    for p, g, w in zip(model.parameters(), u0, w0):
        if p.numel() >= 4096:
            sent = (w - p.detach()) / 0.1  # float16-rounded values, applied
            # what was not sent, the rounding error included, is still in v
            torch.testing.assert_close(sent + opt.state[p]["v"], g, rtol=0, atol=1e-6)


def test_int8_values_cost_one_byte_each_and_keep_the_rounding_error():
    model = W.model_of()
    opt = DGCMomentum(model.parameters(), lr=0.1, sparsity=[0.99], min_numel=4096,
                      value_dtype=torch.int8)
    x, y = W.batch(0, 0)
    (model(x) - y).square().mean().backward()
    u0 = [p.grad.clone() for p in model.parameters()]
    w0 = [p.detach().clone() for p in model.parameters()]
    opt.step()
    big = [p for p in model.parameters() if p.numel() >= 4096]
    ks = [k_of(p.numel(), 0.99) for p in big]
    # an int32 index and an int8 value per pair, and one float32 scale per tensor
    assert opt.telemetry["bytes_gathered"] == sum(ks) * (4 + 1) + 4 * len(big)
    sizes = iter(ks)
    for p, g, w in zip(model.parameters(), u0, w0):
        if p.numel() >= 4096:
            sent = (w - p.detach()) / 0.1
            # what was not sent, the rounding error included, is still in v
            torch.testing.assert_close(sent + opt.state[p]["v"], g, rtol=0, atol=1e-6)
            chosen = sent != 0
            assert 0 < chosen.sum() <= next(sizes)
            # 127 levels of the largest sent magnitude: each sent value within half a level
            top = g[chosen].abs().max()
            assert (sent[chosen] - g[chosen]).abs().max() <= top / 127 / 2 * (1 + 1e-5)


def test_int8_codec_round_trips_through_the_all_gather_path():
    from scaleopt.dgc import comm

    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(k, generator=gen) * 1e-4 for k in (1, 6, 33)] + [torch.zeros(3)]
    indices = [torch.arange(v.numel(), dtype=torch.int32) * 2 for v in values]
    sent = [comm.encode(v, torch.int8) for v in values]
    assert [s.numel() for s in sent] == [v.numel() + 4 for v in values]
    for v, s in zip(values, sent):
        back = comm.decode(s)
        assert back.dtype == torch.float32
        step = v.abs().max() / 127
        assert (back - v).abs().max() <= step / 2 * (1 + 1e-5)  # all zeros: exact
    # mixed with other dtypes in one buffer, decoded by the receiver's path
    means = comm.sparse_allgather_mean(indices + [torch.tensor([5], dtype=torch.int64)],
                                       sent + [torch.tensor([2.5], dtype=torch.float16)],
                                       [80] * 5, None)
    for i, s, d in zip(indices, sent, means):
        want = torch.zeros(80).index_add_(0, i.long(), comm.decode(s))
        assert torch.equal(d, want)
    assert means[-1][5] == 2.5 and means[-1].dtype == torch.float16


def test_pack_keeps_every_segment_aligned_with_odd_k_and_mixed_dtypes():
    from scaleopt.dgc import comm

    gen = torch.Generator().manual_seed(0)
    specs = [(3, torch.int32, torch.float16), (5, torch.int64, torch.float32),
             (1, torch.int32, torch.bfloat16), (7, torch.int32, torch.float32)]
    indices = [torch.randint(0, 100, (k,), generator=gen).to(idt) for k, idt, _ in specs]
    values = [torch.randn(k, generator=gen).to(vdt) for k, _, vdt in specs]
    buf = comm.pack(indices, values)
    assert buf.numel() == sum(k * (i.itemsize + v.itemsize) for k, i, v in specs)
    for (i, v), (i2, v2) in zip(zip(indices, values), comm.unpack(buf, specs)):
        assert i2.dtype == i.dtype and v2.dtype == v.dtype
        assert torch.equal(i, i2) and torch.equal(v, v2)
    # decoding through the same path as the all-gather (one rank)
    means = comm.sparse_allgather_mean(indices, values, [100] * len(specs), None)
    for i, v, d in zip(indices, values, means):
        want = torch.zeros(100, dtype=v.dtype).index_add_(0, i.long(), v)
        assert torch.equal(d, want)


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_the_ddp_hook_state_resumes_from_each_ranks_checkpoint(tmp_path):
    """Each rank saves its own residuals (they differ from rank to rank); the resumed run is
    the uninterrupted one, bit for bit."""
    opts = dict(lr=0.05, momentum=0.9, sparsity=[0.99], min_numel=64)
    straight = W.run_workers(W.train_hook_resumed, 2, tmp_path / "a", opts, 0, 6, str(tmp_path))
    resumed = W.run_workers(W.train_hook_resumed, 2, tmp_path / "b", opts, 3, 3, str(tmp_path))
    for a, b in zip(straight, resumed):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    saved = [torch.load(tmp_path / f"rank{r}.ckpt", weights_only=True)["dgc"] for r in range(2)]
    assert [s["rank"] for s in saved] == [0, 1] and saved[0]["step"] == 3
    name = next(iter(saved[0]["residuals"]))
    assert not torch.equal(saved[0]["residuals"][name]["v"], saved[1]["residuals"][name]["v"])


def test_hook_state_from_another_rank_is_reset_with_a_warning():
    model = W.model_of()
    state = DGCHookState(model, sparsity=[0.99])
    state.residuals = {"0.weight": {"u": torch.ones(2), "v": torch.ones(2)}}
    sd = dict(state.state_dict(), rank=1, world_size=2)
    other = DGCHookState(model, sparsity=[0.99])
    with pytest.warns(UserWarning, match="saved by rank 1 of 2 loaded on rank 0 of 1"):
        other.load_state_dict(sd)
    assert other.residuals == {} and other.step == 0
    other.load_state_dict(state.state_dict())
    assert torch.equal(other.residuals["0.weight"]["v"], torch.ones(2))
