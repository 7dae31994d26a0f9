"""method.budget: per-layer precision chosen to fit a byte budget (division/budget.py)."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from conftest import run_train
from division import budget as budget_lib, engine
from division.methods import build, load_config
from division.models import create_model


def test_parse_budget():
    assert budget_lib.parse_budget("20x") == ("ratio", 20.0)
    assert budget_lib.parse_budget("40MiB") == ("bytes", 40 * 2 ** 20)
    assert budget_lib.parse_budget("1.5GB") == ("bytes", 1_500_000_000)
    for bad in ("0.5x", "20", "-3MiB", "lots", "20 y"):
        with pytest.raises(ValueError, match="valid|invalid"):
            budget_lib.parse_budget(bad)


def _sites(table):
    """Sites from (bytes, variance) option lists, with sensitivities that make rel_error = variance."""
    return {f"s{i}": budget_lib.Site(f"s{i}", "conv", (1,), 1.0,
                                     [budget_lib.Option(f"o{j}", None, b, v) for j, (b, v) in enumerate(opts)])
            for i, opts in enumerate(table)}


def test_allocation_fits_and_beats_every_uniform_choice():
    """On small problems the allocation fits the bytes and its error is at most that of the best choice
    that gives every site the same option, and within the brute-force optimum's reach of one upgrade."""
    torch.manual_seed(0)
    for trial in range(20):
        table = []
        for _ in range(5):
            sizes = sorted(torch.randint(10, 200, (3,)).tolist())
            table.append([(sizes[j], float(torch.rand(1)) * 4 ** (2 - j)) for j in range(3)])
        sites = _sites(table)
        budget = sum(o[0] for o in table[0][:1]) * 3 + sum(opts[1][0] for opts in table[1:])
        choice = budget_lib.allocate(sites, budget)
        used = sum(sites[k].options[i].nbytes for k, i in choice.items())
        err = sum(sites[k].options[i].variance for k, i in choice.items())
        assert used <= budget
        best = min((sum(opts[j][1] for opts in table) for j in range(3)
                    if sum(opts[j][0] for opts in table) <= budget), default=float("inf"))
        assert err <= best + 1e-12
        brute = min(sum(table[s][j][1] for s, j in enumerate(js)) for js in itertools.product(range(3), repeat=5)
                    if sum(table[s][j][0] for s, j in enumerate(js)) <= budget)
        assert err <= 2 * brute + 1e-9  # the Lagrangian sweep plus upgrades: near the optimum, not always on it


def _calibrated(name, budget, model_name="resnet20", batch=16, size=32, **options):
    torch.manual_seed(0)
    model = create_model(model_name, num_classes=10)
    method = build({**load_config(name), "budget": budget, **options})
    method.prepare(model)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    state = engine.StepState(torch.device("cpu"))
    plan = method.calibrate(model, engine._forward(model, x, y, state))
    return model, method, plan, x, y, state


@pytest.mark.parametrize("name,budget", [("division_plus", "12x"), ("division_plus", "20x"), ("division", "10x"),
                                         ("division_plus_compact", "20x"),
                                         ("division", "2MiB")])
def test_held_bytes_fit_the_budget(name, budget):
    """One training step after calibration holds what the plan said, at most the budget and within 3 % of
    it (the plan's bytes are each candidate's measured bytes; what it does not choose is measured too)."""
    model, method, plan, x, y, state = _calibrated(name, budget)
    with method.accounting(model) as acc:
        _, loss = engine._forward(model, x, y, state)()
    loss.backward()
    held = acc.report.held_bytes
    assert held == plan.planned_bytes - plan.headroom_bytes  # the same batch: the positives it planned for
    assert 0.97 * plan.budget_bytes <= held <= plan.budget_bytes, (held, plan.budget_bytes)
    rows = method.describe()["budget_plan"]["layers"]
    assert rows and all({"layer", "choice", "bytes", "est_rel_error"} <= set(r) for r in rows)


def test_budget_below_the_cheapest_plan_names_the_least_feasible():
    with pytest.raises(ValueError, match=r"least feasible budget is \d+ bytes"):
        _calibrated("division_plus", "200x")


def test_more_bytes_buy_less_estimated_error():
    errors = [_calibrated("division_plus", b)[2].describe()["est_rel_error_sum"] for b in ("20x", "12x", "6x")]
    assert errors[0] > errors[1] > errors[2]


def test_calibration_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = create_model("resnet20", num_classes=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    method = build({**load_config("division"), "budget": "15x"})
    method.prepare(model)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    rng = torch.get_rng_state()
    method.calibrate(model, engine._forward(model, x, y, engine.StepState(torch.device("cpu"))))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and torch.equal(rng, torch.get_rng_state())


def test_refresh_replans_during_training():
    model, method, plan, x, y, state = _calibrated("division", "12x", budget_refresh=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        engine.train_step(model, method, x, y, opt, None, state)
    assert method.plan is not plan and method.plan.budget_bytes == plan.budget_bytes


def test_runner_plans_before_training_and_records_the_plan(tmp_path):
    out = run_train(["data=synthetic", "data.train_size=32", "data.test_size=16", "data.batch_size=16",
                     "model=resnet20", "method=division_plus", "method.budget=16x", "trainer.max_steps=2"], tmp_path)
    plan = out["method_info"]["budget_plan"]
    assert out["status"] == "ok" and plan["layers"] and out["act_mem_bytes"] <= plan["budget_bytes"]
    assert out["act_compression"] == pytest.approx(16, rel=0.05)


def test_benchmark_and_max_batch_take_a_budget(tmp_path):
    """scripts/bench.py (and so max_batch's probes) plan a budgeted method before measuring it."""
    from division import bench
    rec = bench.measure("resnet20", 16, "division_plus:budget=12x", 32, steps=1, warmup=1, device_name="cpu",
                        amp="none", num_classes=10)
    assert rec["status"] == "ok" and rec["act_compression"] == pytest.approx(12, rel=0.04)


def test_sites_without_weights_count_their_error_for_every_weighted_layer_below():
    """A batch norm's input error flows down the input gradient to the weight gradients of every convolution
    before it: observed after two convolutions, its estimate is twice the relative activation error; a
    convolution's input counts for its own weight gradient only."""
    import torch.nn as nn
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
    observer = budget_lib.BudgetObserver(model)
    option = [("8b", budget_lib._Bf16())]
    x = torch.randn(2, 4, 8, 8)
    observer.observe("0", "conv", torch.randn(2, 3, 8, 8), option)
    observer.observe("2", "bn", x, option)  # as if the second convolution were not compressed: reach 1
    observer.observe("1", "conv", x, option)
    observer.observe("9", "gelu", x, option)
    sites = observer.sites
    assert [sites[k].reach for k in ("0:conv", "2:bn", "1:conv", "9:gelu")] == [1, 1, 1, 2]
    o = sites["9:gelu"].options[0]
    assert sites["9:gelu"].rel_error(o) == 2 * o.variance / sites["9:gelu"].mean_square
    observer.close()


def _weighted_layers(model):
    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
            and m.weight.requires_grad]


def test_probe_places_each_sites_error_where_backward_carries_it():
    """The measured sensitivities follow backward exactly: a convolution's input changes its own weight
    gradient and nothing else (every other layer's entry is exactly 0: the same arithmetic on the same
    tensors); a batch norm's input changes layers at or before it only; a batch norm a fused convolution
    rebuilds its input from changes that convolution's weight gradient (it would not, were the link lost).
    Residual rebuilds off: they carry a batch norm's error forward (test_probe_follows_residual_rebuilds...)."""
    model, method, plan, x, y, state = _calibrated("division_plus", "12x", budget_residual=False)
    engine._forward(model, x, y, state)()  # a training forward: the policy notes which convolutions it fuses
    layers = _weighted_layers(model)
    order, fused_of = [n for n, _ in model.named_modules()], method.policy.fused
    fused = {s.layer for s in plan.sites.values() if s.kind == "bn"} & set(method.policy.fused.values())
    assert fused and all(s.sensitivities is not None and len(s.sensitivities) == len(layers)
                         for s in plan.sites.values())
    for s in plan.sites.values():
        hit = [layers[i] for i, v in enumerate(s.sensitivities) if v != 0]
        if s.kind == "conv":
            assert hit == [s.layer], (s.layer, hit)
        if s.kind == "bn":  # module order is forward order here
            later = [n for n in hit if order.index(n) > order.index(s.layer) and fused_of.get(n) != s.layer]
            assert not later, (s.layer, later)
    for conv, bn in method.policy.fused.items():
        site = plan.sites[f"{bn}:bn"]
        assert site.sensitivities[layers.index(conv)] > 0, (bn, conv)


def test_probe_or_norms_by_choice():
    """budget_probe=false plans from the observed step's norms (no measured sensitivities); either way the
    plan fits; a probe that is not a boolean is refused by name."""
    *_, plan = _calibrated("division_plus", "12x", budget_probe=False)[:3]
    assert all(s.sensitivities is None for s in plan.sites.values()) and plan.planned_bytes <= plan.budget_bytes
    with pytest.raises(ValueError, match="budget_probe"):
        build({**load_config("division_plus"), "budget": "12x", "budget_probe": "yes"})


def test_groups_follow_a_maps_local_spread():
    """A map whose halves differ 10^4-fold in scale: one range per map spends every level on the loud half,
    a range per 256 elements gives the quiet half its own, so at no more bytes the groups' error is a small
    fraction of the per-map codes' (the reason groups are on the budget's menu)."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 32, 32)
    x[:, :, 16:] *= 1e-4
    method = build({**load_config("division_plus"), "budget": "12x"})
    options = {o.name: o for o in budget_lib.measure_options(x, method._candidates(32, 32))}
    assert {f"{b}b/G256" for b in budget_lib.BITS} <= set(options)
    groups, maps = options["2b/G256"], options["2b/B16"]
    assert groups.nbytes <= options["2b/B8"].nbytes
    quiet = x[:, :, 16:]
    assert groups.variance < 0.6 * maps.variance  # the loud half alone: same levels per group as per map
    decoded = groups.codec.encode(x).decode()[:, :, 16:]
    assert (decoded - quiet).abs().max() <= (quiet.amax() - quiet.amin())  # within its own range, not the map's


def test_groups_on_the_menu_by_choice():
    """budget_groups=false keeps the plan to DIVISION's settings; by default every 4-D site may take groups."""
    *_, plan = _calibrated("division_plus", "16x", budget_groups=False)[:3]
    assert not any("/G" in o.name for s in plan.sites.values() for o in s.options)
    *_, plan = _calibrated("division_plus", "16x")[:3]
    assert all(any(o.name == "2b/G256" for o in s.options) for s in plan.sites.values())
    with pytest.raises(ValueError, match="budget_groups"):
        build({**load_config("division_plus"), "budget": "12x", "budget_groups": 1})


def test_exact_choice_keeps_gradients_bit_for_bit():
    """With bytes to spare every planned site takes "exact" (no error, the least): the activation itself, held
    by reference as plain autograd holds it, so every convolution's and batch norm's gradient equals plain
    autograd's bit for bit (the classifier's 2-D input is outside the plan, held in bf16 as always)."""
    import copy
    torch.manual_seed(0)
    model = create_model("resnet20", num_classes=10)
    plain = copy.deepcopy(model)
    method = build({**load_config("division"), "budget": "1000MiB"})
    method.prepare(model)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    plan = method.calibrate(model, engine._forward(model, x, y, engine.StepState(torch.device("cpu"))))
    assert {r["choice"] for r in plan.describe()["layers"]} == {"exact"}
    for net in (model, plain):
        engine._forward(net, x, y, engine.StepState(torch.device("cpu")))()[1].backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if not name.startswith("fc."):
            assert torch.equal(p.grad, q.grad), name


def test_exact_choice_refuses_an_in_place_change():
    x = torch.randn(2, 3, 4, 4)
    held = budget_lib._Exact().encode(x)
    assert held.decode() is x and held.nbytes() == x.numel() * 4
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        held.decode()


def test_budget_compacts_relu_outputs():
    """Under a budget a ReLU output's codes are kept for its positive elements only (compact_relu: fewer bytes,
    the same error), although division_plus leaves compaction off without one."""
    assert load_config("division_plus")["compact_relu"] is False
    model, method, plan, x, y, state = _calibrated("division_plus", "16x")
    engine._forward(model, x, y, state)()
    kinds = [r.codec for r in method.policy.records if r.kind == "conv" and r.codec]
    assert any("relu-compact" in k for k in kinds), kinds


def test_probe_follows_residual_rebuilds_through_the_chain():
    """Under a budget division_plus rebuilds residual blocks' outputs (budget_residual): a batch norm whose
    output a later block's first convolution rebuilds its input from reaches that convolution's weight gradient,
    and so does every batch norm further up the chain of shortcuts (the probe would see neither were the
    rebuilt inputs left exact); budget_residual=false leaves residual outputs held."""
    model, method, plan, x, y, state = _calibrated("division_plus", "16x")
    engine._forward(model, x, y, state)()
    layers, residual = _weighted_layers(model), dict(method.policy.residual)
    assert len(residual) == 6
    nodes = {**{c: ("bnrelu", f"{b}:bn") for c, b in method.policy.fused.items()}, **residual}
    chained = 0
    for conv, node in residual.items():
        assert plan.sites[node[1]].sensitivities[layers.index(conv)] > 0, (conv, node)
        up = node[2]
        while up[0] == "conv":
            chained += 1
            assert plan.sites[nodes[up[1]][1]].sensitivities[layers.index(conv)] > 0, (conv, up)
            up = nodes[up[1]][2] if nodes[up[1]][0] == "res" else ("end",)
    assert chained >= 6
    model, method, *_ = _calibrated("division_plus", "16x", budget_residual=False)
    assert not method.policy.fuse_residual


def test_plan_counts_a_relu_mask_once_whatever_the_choice():
    """A ReLU's mask is held by the ReLU; a site's codes may use it as their split (a fused batch norm's input, a
    compacted ReLU output) or not (an exact copy, a bf16 copy). The plan counts it with the ReLU's record, so
    what a step holds equals the plan when the choices do not use the masks the observed step's defaults did
    (division_plus with every site exact: before, the masks went uncounted and the step held more than planned)."""
    model, method, plan, x, y, state = _calibrated("division_plus", "1000MiB")
    assert {r["choice"] for r in plan.describe()["layers"]} == {"exact"}
    with method.accounting(model) as acc:
        _, loss = engine._forward(model, x, y, state)()
    loss.backward()
    assert acc.report.held_bytes == plan.planned_bytes - plan.headroom_bytes


def test_a_checkpoint_plan_for_another_model_is_refused():
    """A saved plan is taken back only where it names exactly this step's sites and one of each site's options."""
    from division.budget import Option, Site, _restored
    sites = {"conv1:conv": Site("conv1", "conv", (2, 3, 8, 8), 1.0, [Option("2b/B8", None, 10, 0.1),
                                                                       Option("exact", None, 40, 0.0)])}
    assert _restored(sites, {"conv1:conv": "exact"}) == {"conv1:conv": 1}
    with pytest.raises(ValueError, match="names sites .*conv2:conv.*resume=false"):
        _restored(sites, {"conv2:conv": "exact"})
    with pytest.raises(ValueError, match=r"chose '4b/B8' at conv1:conv; valid choices there: \['2b/B8', 'exact'\]"):
        _restored(sites, {"conv1:conv": "4b/B8"})
