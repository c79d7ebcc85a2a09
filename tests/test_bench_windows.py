"""The bench with sliding-window layers (`--window-size LEFT,0 [--window-attn-skip-freq N]`): bytes per rank of
CSBP, the field's CP and pure BP side by side, measured by the ops' counters and counted off the plans, against a
formula derived here by hand.

The hand formula, `P = C`, zigzag clean chunks of `c = L/2C` tokens holding whole blocks, dual-end noisy blocks
(which lie in the rank's own chunks), `LEFT <= c`, fp32, `β = 2·G·d·4` bytes per token (`G` query groups of `d`
channels), collective transport, one step (forward + backward):
* a global layer: CSBP sends `L(C-1)/C` clean rows and gets as many dK/dV back, `2L(C-1)/C·β`; the field's CP both
  copies, `4L(C-1)/C·β`; BP nothing;
* a sliding layer: under CSBP every chunk but the first needs the `LEFT` clean rows before it, from its neighbour
  chunk's owner; rank `r` holds chunks `r` and `2C-1-r`, so it has `n_r = [r > 0] + [r < C-1]` neighbour chunks on
  other ranks and sends (and gets back gradients of) `LEFT` rows for each: `2·LEFT·β·n_r`. CP's all-gather and BP
  are as in a global layer.
"""

import pytest

from megatron_csbp.tools.bench import cli, command, traffic


def _hand_bytes(mode, L, P, left, skip, layers, groups, channels):
    """Every rank's bytes of one step, by the module docstring's formula."""
    beta = 2 * groups * channels * 4
    sliding = [left is not None and layer % skip != 0 for layer in range(1, layers + 1)]
    per_rank = []
    for r in range(P):
        total = 0
        for slides in sliding:
            if mode == "bp":
                continue
            if mode == "cp":
                total += 4 * L * (P - 1) // P * beta
            elif slides:
                total += 2 * left * beta * ((r > 0) + (r < P - 1))
            else:
                total += 2 * L * (P - 1) // P * beta
        per_rank.append(total)
    return tuple(per_rank)


def _args(L, P, left, skip, layers=6):
    window = [] if left is None else ["--window-size", f"{left},0", "--window-attn-skip-freq", str(skip)]
    return cli.parse_args(["--bytes-only", "--modes", "csbp,cp,bp", "--seq-lengths", str(L), "--nproc", str(P),
                           "--block-size", "64", "--num-layers", str(layers), *window])


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("L", [8192, 65536])
def test_counted_bytes_equal_the_hand_formula_and_fall_with_the_window(L, P):
    channels, groups = 128 // 4, 2
    previous = None
    for left in (None, 1023, 511, 255, 63):  # every window within a chunk at L >= 8K, P <= 4
        if left is not None:
            assert left <= L // (2 * P)
        args = _args(L, P, left, 6)
        counted = {run.mode.name: traffic.exact_bytes_by_rank(run) for run in cli.runs(args)}
        for mode in ("csbp", "cp", "bp"):
            assert counted[mode] == _hand_bytes(mode, L, P, left, 6, 6, groups, channels), (mode, left)
        if previous is not None:
            assert sum(counted["csbp"]) < sum(previous["csbp"])  # falls as the window shrinks
            assert counted["cp"] == previous["cp"]  # the field's all-gather does not
        previous = counted
    assert max(previous["csbp"]) < max(previous["cp"]) / 4


def test_an_off_by_one_formula_misses():
    """Negative control: the hand formula at LEFT + 1 does not equal the count at LEFT."""
    args = _args(8192, 2, 511, 6)
    csbp = next(run for run in cli.runs(args) if run.mode.name == "csbp")
    assert traffic.exact_bytes_by_rank(csbp) != _hand_bytes("csbp", 8192, 2, 512, 6, 6, 2, 32)


def test_bytes_only_prints_every_rank_and_the_ratio_to_cp(capsys):
    assert command.main(["--bytes-only", "--modes", "csbp,cp,bp", "--seq-lengths", "8192", "--nproc", "4",
                         "--block-size", "64", "--window-size", "511,0", "--window-attn-skip-freq", "6",
                         "--num-layers", "6"]) == []
    out = capsys.readouterr().out
    hand = _hand_bytes("csbp", 8192, 4, 511, 6, 6, 2, 32)
    whole = _hand_bytes("csbp", 8192, 4, None, 6, 6, 2, 32)
    cp = _hand_bytes("cp", 8192, 4, None, 6, 6, 2, 32)
    line = next(line for line in out.splitlines() if line.startswith("csbp"))
    assert " ".join(f"{b:,}" for b in hand) in line and " ".join(f"{b:,}" for b in whole) in line
    assert f"{max(hand) / max(cp):.4f}" in line
    assert "every 6-th layer global" in out


def test_the_measured_counters_equal_the_count_and_the_formula(capsys):
    """Two spawned ranks, one sliding and one global layer: every rank's counter is the count off the plans and the
    hand formula, for CSBP, CP and BP in one run."""
    records = command.main(["--modes", "csbp,cp,bp", "--seq-lengths", "512", "--nproc", "2", "--block-size", "16",
                            "--window-size", "31,0", "--window-attn-skip-freq", "2", "--num-layers", "2",
                            "--hidden-size", "64", "--vocab-size", "128", "--steps", "1", "--warmup", "0"])
    by_mode = {r["mode"]: r for r in records}
    for mode in ("csbp", "cp", "bp"):
        hand = _hand_bytes(mode, 512, 2, 31, 2, 2, 2, 16)
        assert tuple(by_mode[mode]["bytes_sent_by_rank"]) == tuple(by_mode[mode]["exact_bytes_by_rank"]) == hand
    assert by_mode["csbp"]["bytes_sent_per_rank"] < by_mode["cp"]["bytes_sent_per_rank"] / 3
    assert "equal" in capsys.readouterr().out


def test_window_flags_are_the_trainers(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--seq-lengths", "512", "--block-size", "16", "--window-size", "31,4"])
    assert "--window-size 31,4: a right window" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--seq-lengths", "512", "--block-size", "16", "--window-attn-skip-freq", "2"])
    assert "there is no --window-size" in capsys.readouterr().err
