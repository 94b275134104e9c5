"""The multirow kernel's routing (``mlx_dspark.targets.multirow``): which
modules, which rows, and only inside a speculative verify. The kernel is
CUDA's; here a stand-in that dequantizes takes its place and records what
it was given."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

import mlx_dspark
from mlx_dspark.confidence.costs import RoundTimer
from mlx_dspark.plugins import find_target_adapter
from mlx_dspark.speculative.engine import adapt_target
from mlx_dspark.targets import multirow

from conftest import FIXTURES
from test_batching import check_batch
from tiny import gemma4_text_args, plain_greedy, speculative, tiny_dspark, tiny_gemma4, tiny_qwen3


TIMED_KERNEL_FASTER = multirow.kernel_faster  # the fixture below replaces it


def quantized(model, bits=4):
    nn.quantize(
        model, group_size=32, bits=bits,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    return model


@pytest.fixture
def kernel_rows(monkeypatch, tmp_path):
    """The rows each call of the (stand-in) kernel was given. The kernel is
    timed faster than MLX's at every shape and row count (this CPU's timings
    would choose by chance), with the choices kept in a cache folder of the
    test's own."""
    seen = []

    def stand_in(x, w, scales, biases, group_size):
        seen.append(x.shape[0])
        return x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=4).T

    monkeypatch.setattr(multirow, "multirow_matmul", stand_in)
    monkeypatch.setattr(multirow, "kernel_faster", lambda modules, rows: True)
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    return seen


def test_route_gives_only_modules_the_kernel_computes_the_subclass_and_keeps_the_parameters():
    """4-bit affine without bias, in groups of 32-128, outputs in whole
    warps' columns: routed (the tied head too); 8-bit, biased, mxfp4, groups
    of 16 and outputs not a multiple of the columns stay MLX's."""
    model = quantized(tiny_qwen3(seed=1, tie=True))
    mlp = model.model.layers[0].mlp
    mlp.eight_bit = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=8)
    mlp.biased = nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=4)
    mlp.mxfp4 = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4, mode="mxfp4")
    mlp.groups_of_16 = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
    mlp.groups_of_16.group_size = 16  # MLX 0.32 has none; a lane's 32 weights would span two
    mlp.odd_outputs = nn.QuantizedLinear(64, 30, bias=False, group_size=32, bits=4)
    left_alone = ["eight_bit", "biased", "mxfp4", "groups_of_16", "odd_outputs"]
    before = tree_flatten(model.parameters())
    fitting = [
        name for name, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and name.rpartition(".")[2] not in left_alone
    ]
    assert multirow.route(model) == len(fitting) > 0
    routed = [name for name, m in model.named_modules() if type(m) in multirow.ROUTED.values()]
    assert sorted(routed) == sorted(fitting)
    assert "model.embed_tokens" in routed  # the tied head
    assert all(type(mlp[name]) is nn.QuantizedLinear for name in left_alone)
    after = tree_flatten(model.parameters())
    assert [k for k, _ in after] == [k for k, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before))
    assert multirow.route(model) == len(fitting)  # again: nothing more


@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (8, 1), (1, 5), (2, 3), (1, 40)])
def test_outside_a_verify_routed_modules_are_mlx_own_at_any_rows(kernel_rows, shape):
    """mlx-lm's own forwards (plain decoding, its batched decoding at 2-8
    sequences, a prompt) on a routed model never reach the kernel, and are
    bit-identical to the model's before routing; ``unroute`` gives the
    modules back MLX's classes."""
    model = quantized(tiny_qwen3(seed=2, tie=True))
    tokens = mx.random.randint(0, 96, shape, key=mx.random.key(0))
    expected = model(tokens, make_prompt_cache(model))
    assert multirow.route(model) > 0
    assert mx.array_equal(model(tokens, make_prompt_cache(model)), expected)
    assert kernel_rows == []
    multirow.unroute(model)
    assert multirow.routed_count(model) == 0
    assert all(type(m) not in multirow.ROUTED.values() for _, m in model.named_modules())


@pytest.mark.parametrize("length, by_kernel", [(1, False), (2, True), (7, True), (8, True), (9, False), (30, False)])
def test_a_target_forward_runs_2_to_8_rows_by_the_kernel(kernel_rows, length, by_kernel):
    """Inside the adapter's forward, 2-8 rows (a verify's, or a short prompt
    chunk's) take the kernel in every routed projection and the tied head,
    and give the same logits; one row (a parked round's) and longer chunks
    stay MLX's."""
    model = quantized(tiny_qwen3(seed=3, tie=True))
    target = find_target_adapter(model).adapt(model)
    tokens = mx.random.randint(0, 96, (1, length), key=mx.random.key(1))
    expected = target(tokens, target.make_cache(8)).logits
    routed = multirow.route(model)
    logits = target(tokens, target.make_cache(8)).logits
    assert mx.allclose(logits, expected, atol=1e-4).item()
    assert kernel_rows == ([length] * routed if by_kernel else [])


def test_inputs_mlx_would_promote_or_refuse_stay_mlx_own(kernel_rows):
    """The kernel computes in the inputs' dtype with the scales cast to it:
    inputs of another dtype than the scales' (which MLX promotes) and of a
    width that is not the weights' (which MLX refuses) stay MLX's."""
    linear = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
    assert multirow.route(linear) == 1
    x = mx.random.normal((4, 64), key=mx.random.key(2))
    with multirow.verifying():
        assert linear(x.astype(mx.bfloat16)).dtype == mx.float32  # MLX's promotion
        with pytest.raises(ValueError):
            linear(mx.zeros((4, 32)))
        assert kernel_rows == []
        linear(x)
    assert kernel_rows == [4]


def test_speculative_decoding_on_a_routed_4_bit_target_is_lossless(kernel_rows, monkeypatch):
    """With routing available, ``adapt_target`` routes the target, its
    verifies run by the kernel, and the output is plain greedy decoding's."""
    monkeypatch.setattr(multirow, "available", lambda: True)
    model, _ = load(str(FIXTURES / "deepspec-tiny" / "target_tiny_gemma4"))
    quantized(model)
    drafter = mlx_dspark.load_drafter(FIXTURES / "deepspec-tiny" / "dspark_tiny_gemma4_block4")
    adapt_target(model, drafter)
    assert multirow.routed_count(model) > 0
    kernel_rows.clear()  # the check before routing's product
    for prompt in ([65, 211, 266, 241, 234], [9, 8, 7]):
        expected = plain_greedy(model, prompt, 30)
        ours, stats = speculative(model, drafter, prompt, 30)
        assert ours == expected and stats.accepted > 0
    assert kernel_rows


def test_a_routed_4_bit_target_batches_equal_greedy(kernel_rows, monkeypatch):
    """The batched generator's verifies (several sequences' rows at once,
    flattened for the kernel) on a routed target: each request its own
    greedy output."""
    monkeypatch.setattr(multirow, "available", lambda: True)
    model = quantized(tiny_gemma4(seed=6))
    drafter = tiny_dspark(gemma4_text_args(), seed=7)
    requests = [
        (0, [5, 17, 33], dict(max_tokens=[14]), ()),
        (0, [61, 8, 90, 12, 40, 7], dict(max_tokens=[10]), ()),
        (1, [23], dict(max_tokens=[12], num_draft_tokens=[1]), ()),
    ]
    sizes = dict(completion_batch_size=3, prefill_batch_size=2, prefill_step_size=2048)
    adapt_target(model, drafter)
    assert multirow.routed_count(model) > 0
    kernel_rows.clear()  # the check before routing's product
    check_batch(model, drafter, requests, sizes, seed=8)
    assert kernel_rows


def test_routing_needs_mlx_cuda_on_the_gpu_and_can_be_turned_off(kernel_rows, monkeypatch, capsys):
    """``adapt_target`` routes a target only on MLX-CUDA's GPU, and not
    with ``MLX_DSPARK_MULTIROW=0``; routing says so once, and how to turn it
    off, and that a machine's first use times (and compiles) the kernel."""
    model, _ = load(str(FIXTURES / "deepspec-tiny" / "target_tiny_gemma4"))
    quantized(model)
    drafter = mlx_dspark.load_drafter(FIXTURES / "deepspec-tiny" / "dspark_tiny_gemma4_block4")
    adapt_target(model, drafter)  # this machine: MLX on the CPU
    assert multirow.routed_count(model) == 0
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setenv("MLX_DSPARK_MULTIROW", "0")
    adapt_target(model, drafter)
    assert multirow.routed_count(model) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("MLX_DSPARK_MULTIROW")
    adapt_target(model, drafter)
    assert multirow.routed_count(model) > 0
    said = capsys.readouterr().err
    assert "timing the multirow kernel" in said and "compiles" in said
    assert "verifies by the plugin's multirow kernel" in said and "MLX_DSPARK_MULTIROW=0" in said
    adapt_target(model, drafter)  # the next generation's
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MLX_DSPARK_MULTIROW", "0")  # turned off since: routed back
    adapt_target(model, drafter)
    assert multirow.routed_count(model) == 0


def test_a_routed_target_has_cost_profiles_of_its_own(monkeypatch):
    """Verify costs measured with the kernel are not MLX's: a routed
    target's profile key differs, so neither is read for the other, and so
    does one whose kernel rows were chosen otherwise."""
    model = quantized(tiny_qwen3(seed=5))
    drafter = mlx_dspark.load_drafter(FIXTURES / "deepspec-tiny" / "dspark_tiny_gemma4_block4")

    def key():
        return RoundTimer(model, drafter, 4, verify=None, draft=None).key

    before = key()
    assert key() == before
    multirow.route(model)
    routed = key()
    assert routed != before
    model.model.layers[0].mlp.down_proj.kernel_rows = frozenset({8})  # chosen otherwise
    assert key() not in (before, routed)


def timed(faster):
    """A ``kernel_faster`` that answers ``faster(shape, rows)`` and records
    what it was asked (one shape's modules at a time)."""
    asked = []

    def kernel_faster(modules, rows):
        shapes = {multirow.shape_key(m) for m in modules}
        assert len(shapes) == 1
        asked.append((shapes.pop(), rows, len(modules)))
        return faster(asked[-1][0], rows)

    return kernel_faster, asked


def test_choose_keeps_the_kernel_only_at_the_shapes_and_rows_it_was_timed_faster(kernel_rows, monkeypatch):
    """Each shape is timed at 2-8 rows, all its modules together; a routed
    module keeps the kernel at the rows it was faster, and goes back to
    MLX's class where it was faster at none (here the tied head's shape); a
    forward then takes the kernel only there, with the same logits."""
    model = quantized(tiny_qwen3(seed=4, tie=True))
    target = find_target_adapter(model).adapt(model)
    head = multirow.shape_key(model.model.embed_tokens)
    kernel_faster, asked = timed(lambda shape, rows: rows % 2 == 0 and shape != head)
    monkeypatch.setattr(multirow, "kernel_faster", kernel_faster)
    routed = multirow.route(model)
    shapes = {multirow.shape_key(m): 0 for _, m in model.named_modules() if type(m) in multirow.ROUTED.values()}
    for _, m in model.named_modules():
        if type(m) in multirow.ROUTED.values():
            shapes[multirow.shape_key(m)] += 1
    assert len(shapes) > 2
    assert multirow.choose(model) == routed - shapes[head]
    assert sorted(asked) == sorted((s, rows, n) for s, n in shapes.items() for rows in multirow.ROWS)
    assert type(model.model.embed_tokens) is nn.QuantizedEmbedding
    assert multirow.routing(model) == sorted((s, (2, 4, 6, 8)) for s in shapes if s != head)
    for length in (3, 4):
        tokens = mx.random.randint(0, 96, (1, length), key=mx.random.key(length))
        kernel_rows.clear()
        logits = target(tokens, target.make_cache(8)).logits
        multirow.unroute(model)
        assert mx.allclose(logits, target(tokens, target.make_cache(8)).logits, atol=1e-4).item()
        multirow.route(model)
        multirow.choose(model)
        assert kernel_rows == ([length] * (routed - shapes[head]) if length == 4 else [])


def test_a_machine_times_each_shape_once(kernel_rows, monkeypatch, capsys, tmp_path):
    """The choices are kept in the cache folder per device, MLX, launch
    settings, kernel and timing: a second model of the same shapes is not
    timed again (and nothing is said), a new shape is, and is added to the
    others; a file that cannot be read, or another device, is timed again."""
    kernel_faster, asked = timed(lambda shape, rows: rows < 5)
    monkeypatch.setattr(multirow, "kernel_faster", kernel_faster)

    def routed_model(new_shape=False):
        model = quantized(tiny_qwen3(seed=5))
        if new_shape:
            model.model.layers[0].mlp.new = nn.QuantizedLinear(64, 36, bias=False, group_size=32, bits=4)
        multirow.route(model)
        return model

    first = multirow.choose(routed_model())
    timings = len(asked)
    assert first > 0 and timings > 0
    assert "timing the multirow kernel" in capsys.readouterr().err
    assert multirow.choose(routed_model()) == first
    assert len(asked) == timings and capsys.readouterr().err == ""
    multirow.choose(routed_model(new_shape=True))
    assert len(asked) == timings + len(multirow.ROWS)
    multirow.choose(routed_model())
    multirow.choose(routed_model(new_shape=True))
    assert len(asked) == timings + len(multirow.ROWS)  # both kept
    path = multirow.choices_path()
    assert path.parent.parent == tmp_path
    for change in (
        lambda m: m.setattr(multirow.mx, "__version__", "0.0.0"),
        lambda m: m.setenv("MLX_USE_CUDA_GRAPHS", "0"),
        lambda m: m.setattr(multirow, "SOURCE", multirow.SOURCE + "\n"),
        lambda m: m.setattr(multirow, "TIMING", "side by side"),
    ):
        with monkeypatch.context() as m:
            change(m)
            assert multirow.choices_path() != path
    assert multirow.choices_path() == path
    path.write_text("{not json")
    multirow.choose(routed_model())
    assert len(asked) == 2 * timings + len(multirow.ROWS)
    real = multirow.costs.device_identity()
    monkeypatch.setattr(multirow.costs, "device_identity", lambda: {**real, "device_name": "another GPU"})
    assert multirow.choices_path() != path
    multirow.choose(routed_model())
    assert len(asked) == 3 * timings + len(multirow.ROWS)


@pytest.mark.parametrize("content", ["[]", '{"SHAPE": 5}', '{"SHAPE": [1, 9]}', '{"SHAPE": [2, "8"]}'])
def test_a_malformed_choices_file_is_timed_again(kernel_rows, monkeypatch, content):
    """A file that is no mapping, or whose rows are no list of 2-8, is
    not read (so the kernel never takes 1 or 9 rows from a file): its
    shapes are timed again, and the file rewritten."""
    kernel_faster, asked = timed(lambda shape, rows: True)
    monkeypatch.setattr(multirow, "kernel_faster", kernel_faster)
    model = quantized(tiny_qwen3(seed=7))
    multirow.route(model)
    shape = multirow.shape_key(model.model.layers[0].mlp.down_proj)
    path = multirow.choices_path()
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("SHAPE", shape))
    assert multirow.choose(model) > 0
    assert {rows for s, rows, _ in asked if s == shape} == set(multirow.ROWS)
    assert all(rows == tuple(multirow.ROWS) for _, rows in multirow.routing(model))
    assert json.loads(path.read_text())[shape] == list(multirow.ROWS)


def test_a_kernel_that_fails_at_a_shape_leaves_that_shape_to_mlx(kernel_rows, monkeypatch, capsys):
    """Where the kernel does not compile or run at one shape and row count
    (the check before routing tried one small product), MLX's kernels take
    that shape's rows; the others keep the kernel."""
    model = quantized(tiny_qwen3(seed=8))
    multirow.route(model)
    failing = multirow.shape_key(model.model.layers[0].mlp.down_proj)

    def kernel_faster(modules, rows):
        if multirow.shape_key(modules[0]) == failing and rows == 3:
            raise RuntimeError("no kernel image is available")
        return True

    monkeypatch.setattr(multirow, "kernel_faster", kernel_faster)
    multirow.choose(model)
    rows = dict(multirow.routing(model))
    assert rows.pop(failing) == (2, 4, 5, 6, 7, 8)
    assert rows and all(r == tuple(multirow.ROWS) for r in rows.values())
    assert f"not used at {failing}, 3 rows: no kernel image" in capsys.readouterr().err


def test_a_target_timed_slower_everywhere_is_not_timed_again_each_generation(kernel_rows, monkeypatch):
    """``adapt_target`` tries routing a target once a process: where the
    kernel was slower at every shape, the next generations neither check
    nor time it again (even where the choices could not be kept)."""
    monkeypatch.setattr(multirow, "available", lambda: True)
    kernel_faster, asked = timed(lambda shape, rows: False)
    monkeypatch.setattr(multirow, "kernel_faster", kernel_faster)
    monkeypatch.setenv("MLX_DSPARK_CACHE", "/dev/null/nowhere")
    checks = []
    works = multirow.works
    monkeypatch.setattr(multirow, "works", lambda: checks.append(1) or works())
    model, _ = load(str(FIXTURES / "deepspec-tiny" / "target_tiny_gemma4"))
    quantized(model)
    drafter = mlx_dspark.load_drafter(FIXTURES / "deepspec-tiny" / "dspark_tiny_gemma4_block4")
    prompt = [65, 211, 266, 241, 234]
    for _ in range(3):
        assert speculative(model, drafter, prompt, 8)[0] == plain_greedy(model, prompt, 8)
    assert multirow.routed_count(model) == 0
    assert len(checks) == 1 and 0 < len(asked) <= 10 * len(multirow.ROWS)
    timings = len(asked)
    multirow.unroute(model)  # routing turned off and on again: tried again
    adapt_target(model, drafter)
    assert len(checks) == 2 and len(asked) == 2 * timings


def test_an_unwritable_cache_folder_costs_a_timing_not_the_routing(kernel_rows, monkeypatch, tmp_path):
    """Where the choices cannot be kept (the cache folder is a file), the
    target is still routed as timed, and the next model is timed again."""
    kernel_faster, asked = timed(lambda shape, rows: rows == 8)
    monkeypatch.setattr(multirow, "kernel_faster", kernel_faster)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(blocked))
    for timings in (1, 2):
        model = quantized(tiny_qwen3(seed=6))
        multirow.route(model)
        assert multirow.choose(model) > 0
        assert {rows for _, rows in multirow.routing(model)} == {(8,)}
        assert len(asked) == timings * len({s for s, _, _ in asked}) * len(multirow.ROWS)


@pytest.mark.parametrize("kernel_seconds, faster", [(1.0, True), (3.0, False)])
def test_kernel_faster_compares_the_kernel_s_time_with_mlx_s(monkeypatch, kernel_seconds, faster):
    """``kernel_faster`` times the kernel on all the modules of a shape at
    the rows asked, each product reading the one before's outputs (on a GPU
    independent ones run side by side), against MLX's kernels on the same
    (the clock injected: what ran the kernel between two readings took
    ``kernel_seconds``, anything else 2)."""
    inputs = []

    def stand_in(x, w, scales, biases, group_size):
        inputs.append(x)
        return x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=4).T

    readings = []

    def clock():  # a reading before each timed call, and one after
        readings.append(len(inputs))
        if len(readings) % 2:
            return 0.0
        return kernel_seconds if readings[-1] > readings[-2] else 2.0

    monkeypatch.setattr(multirow, "multirow_matmul", stand_in)
    modules = [nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4) for _ in range(3)]
    assert TIMED_KERNEL_FASTER(modules, 5, clock=clock) is faster
    assert [x.shape for x in inputs] == [(5, 64)] * 3 * 2 * multirow.costs.REPEATS  # untimed and timed, each pass
    first, second, third = inputs[:3]
    assert second is not first and third is not second  # each the one before's outputs
    assert mx.array_equal(second, first).item()  # passed on, not changed


def test_the_doctor_says_how_many_modules_the_multirow_kernel_verifies(kernel_rows, monkeypatch, capsys, tmp_path):
    """``mlx_dspark doctor``'s pair: the modules routed (none on this CPU),
    and its text says so where there are any."""
    from mlx_dspark import doctor

    model, _ = load(str(FIXTURES / "deepspec-tiny" / "target_tiny_gemma4"))
    quantized(model)
    drafter = mlx_dspark.load_drafter(FIXTURES / "deepspec-tiny" / "dspark_tiny_gemma4_block4")
    assert doctor.describe_pair(model, drafter, adapt_target(model, drafter))["target"]["multirow"] == 0
    monkeypatch.setattr(multirow, "available", lambda: True)
    routed = doctor.describe_pair(model, drafter, adapt_target(model, drafter))["target"]["multirow"]
    assert routed == multirow.routed_count(model) > 0

    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"draft": 1.0, "verify": [10.0] * 5}))
    path = FIXTURES / "deepspec-tiny"
    argv = ["--model", str(path / "target_tiny_gemma4"), "--draft-model", str(path / "dspark_tiny_gemma4_block4")]
    assert doctor.main([*argv, "--costs", str(costs), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pair"]["target"]["multirow"] == 0  # a float target: nothing routed
    assert "multirow" not in doctor.format_report(report)
    report["pair"]["target"]["multirow"] = routed
    assert f"verified by the multirow kernel in {routed} modules" in doctor.format_report(report)


@pytest.mark.parametrize("failure", ["no compiler", "wrong product", "groups mixed up"])
def test_a_kernel_that_does_not_compile_or_compute_is_not_used(monkeypatch, capsys, failure):
    """Before routing, the kernel computes a small product: where it cannot
    (no NVRTC, here MLX on the CPU) or computes another product than MLX's,
    the target stays on MLX's kernels, losslessly, and stderr says why."""
    if failure == "wrong product":
        monkeypatch.setattr(multirow, "multirow_matmul", lambda x, w, *_: mx.zeros((x.shape[0], w.shape[0])))
    if failure == "groups mixed up":  # each output row's group scales the wrong way round
        def mixed_up(x, w, scales, biases, group_size):
            return x @ mx.dequantize(w, scales[:, ::-1], biases, group_size=group_size, bits=4).T
        monkeypatch.setattr(multirow, "multirow_matmul", mixed_up)
    monkeypatch.setattr(multirow, "available", lambda: True)
    model, _ = load(str(FIXTURES / "deepspec-tiny" / "target_tiny_gemma4"))
    quantized(model)
    drafter = mlx_dspark.load_drafter(FIXTURES / "deepspec-tiny" / "dspark_tiny_gemma4_block4")
    prompt = [65, 211, 266, 241, 234]
    ours, _ = speculative(model, drafter, prompt, 12)
    assert ours == plain_greedy(model, prompt, 12)
    assert multirow.routed_count(model) == 0
    said = capsys.readouterr().err
    why = "did not compile or run" if failure == "no compiler" else "computed another product than MLX's"
    assert f"the multirow kernel is not used: it {why}" in said


def test_checking_a_pair_before_loading_it_routes_and_times_nothing(monkeypatch):
    """``mlx_lm.generate``'s preflight and the server's check of a request
    for another model adapt a lazily loaded target to check the drafter
    against it: neither routes it nor times the kernel, which would read a
    whole 4-bit target's weights only to check a pair."""
    from mlx_dspark.integration import checks, cli

    monkeypatch.setattr(multirow, "available", lambda: True)
    tried = []
    monkeypatch.setattr(multirow, "works", lambda: tried.append("works") or "")
    monkeypatch.setattr(multirow, "kernel_faster", lambda modules, rows: tried.append("timed") or True)
    targets = []

    def lazy_4_bit(*args, **kwargs):
        model, rest = load(*args, **kwargs)
        assert kwargs.get("lazy")
        targets.append(quantized(model))
        return model, rest

    monkeypatch.setattr(cli, "load_model", lazy_4_bit)
    monkeypatch.setattr(checks, "load", lazy_4_bit)
    monkeypatch.setattr(cli, "preloaded", {})
    path = FIXTURES / "deepspec-tiny"
    target, draft = str(path / "target_tiny_gemma4"), str(path / "dspark_tiny_gemma4_block4")
    cli.preflight(target, draft, mlx_dspark.load_drafter(draft, lazy=True))
    assert checks._unloaded.__wrapped__(target, None, draft) is not None
    assert len(targets) == 2 and any(map(multirow.fits, targets[0].modules()))
    assert tried == [] and all(multirow.routed_count(t) == 0 for t in targets)
