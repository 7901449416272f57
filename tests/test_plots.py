"""mhc.train.plots: each figure writes a readable PNG from plain data, and gain lines at ~1 stay distinguishable."""

import math
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest

from mhc.train import plots

TOKENS_PER_STEP = 16384
DEPTH = 24


def train_records(n=60, bad=()):
    """Train records with a decaying loss; steps listed in ``bad`` get NaN / +Inf losses."""
    recs = []
    for i in range(1, n + 1):
        loss = 2.0 + 7.0 * math.exp(-i / 15)
        if i in bad:
            loss = float("nan") if i % 2 else float("inf")
        recs.append(
            {"kind": "train", "step": 10 * i, "tokens": 10 * i * TOKENS_PER_STEP, "loss": loss, "lr": 1e-3}
        )
    return recs


def eval_records(n=6, none_at=()):
    return [
        {
            "kind": "eval",
            "step": 100 * i,
            "tokens": 100 * i * TOKENS_PER_STEP,
            "val_loss": None if i in none_at else 2.0 + 3.0 / i,
        }  # fmt: skip
        for i in range(1, n + 1)
    ]


def mhc_gains():
    d = np.arange(1, DEPTH + 1)
    return {
        "forward_gain": list(1 + 3e-8 * d),
        "backward_gain": list(1 + 6e-8 * d),
        "spectral_norm": list(1 - 1e-9 + 2e-8 * d),
    }


def hc_gains():
    d = np.arange(1, DEPTH + 1)
    return {
        "forward_gain": list(3 + 6 * d),
        "backward_gain": list(2 + 5 * d),
        "spectral_norm": list(2 + 4 * d),
    }


def read_png(path):
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4) and min(img.shape[:2]) >= 300, img.shape
    assert img[..., :3].std() > 0.01, "blank image"
    return img


def line_style(line):
    return (
        line.get_color(),
        line.get_linestyle(),
        line.get_marker(),
        line.get_markersize(),
        line.get_markerfacecolor(),
    )


def test_plot_loss_writes_png_and_skips_nonfinite(tmp_path):
    train = train_records(bad=(7, 8, 30))
    evals = eval_records(none_at=(3,)) + [{"kind": "eval", "step": 700, "tokens": 700 * TOKENS_PER_STEP,
                                          "val_loss": float("nan")}]  # fmt: skip
    out = plots.plot_loss(
        train, evals, title="mhc (n=4)", unigram_entropy=6.7, path=tmp_path / "sub" / "loss.png"
    )
    assert out == tmp_path / "sub" / "loss.png"
    read_png(out)

    fig = plots.loss_figure(train, evals, title="mhc (n=4)", unigram_entropy=6.7)
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    raw = lines["train (3 non-finite not drawn)"]
    assert len(raw.get_ydata()) == 57 and np.isfinite(raw.get_ydata()).all()
    assert np.isfinite(lines["train (EMA)"].get_ydata()).all()
    val = lines["val (2 non-finite not drawn)"]
    assert len(val.get_xdata()) == 5
    assert "unigram entropy (6.700)" in lines
    texts = [t.get_text() for t in ax.texts]
    assert any("step 600" in t for t in texts), texts  # the last finite val point names its step


def test_loss_top_axis_is_in_steps():
    fig = plots.loss_figure(train_records(), eval_records(), title="t", unigram_entropy=None)
    (ax,) = fig.axes
    fig.draw_without_rendering()
    (top,) = ax.child_axes
    assert top.get_xlabel() == "step"
    steps = [s for s in top.get_xticks() if 0 < s * TOKENS_PER_STEP < ax.get_xlim()[1]]
    assert len(steps) >= 3, steps
    # A step tick on the top axis sits right over the same step's tokens on the bottom axis.
    on_top = [top.transData.transform((s, 0))[0] for s in steps]
    below = [ax.transData.transform((s * TOKENS_PER_STEP, 0))[0] for s in steps]
    np.testing.assert_allclose(on_top, below, atol=1e-6)


def test_plot_loss_empty_eval_and_no_data(tmp_path):
    read_png(plots.plot_loss(train_records(), [], title="hc", unigram_entropy=6.7, path=tmp_path / "a.png"))
    fig = plots.loss_figure([], [], title="empty", unigram_entropy=None)
    assert any("no finite losses" in t.get_text() for t in fig.axes[0].texts)
    read_png(plots.plot_loss([], [], title="empty", unigram_entropy=None, path=tmp_path / "b.png"))


def test_gains_near_one_get_a_deviation_panel_with_three_distinct_lines(tmp_path):
    g = mhc_gains()
    read_png(plots.plot_gains(g, title="mhc (n=4)", step=1750, path=tmp_path / "gains.png"))
    fig = plots.gains_figure(g, title="mhc (n=4)", step=1750)
    assert len(fig.axes) == 2, "no |gain - 1| panel for gains at ~1"
    ax_gain, ax_dev = fig.axes
    assert "step 1750" in ax_gain.get_title()
    assert ax_gain.get_ylim() == (0.9, 1.1)
    assert ax_dev.get_yscale() == "log"
    dev_lines = [line for line in ax_dev.get_lines() if len(line.get_xdata()) == DEPTH]
    assert len(dev_lines) == 3
    for line, key in zip(dev_lines, ("forward_gain", "backward_gain", "spectral_norm")):
        np.testing.assert_allclose(line.get_ydata(), np.abs(np.array(g[key]) - 1), rtol=1e-12)
    # The deviations are 1e-9..1e-6 apart, far more than a log panel needs to separate them.
    assert len({line_style(line) for line in dev_lines}) == 3
    labels = ax_gain.get_legend().get_texts()
    assert any(t.get_text().endswith("1 + 7.2e-07 at full depth") for t in labels), [
        t.get_text() for t in labels
    ]


def test_identical_gain_series_stay_distinguishable():
    same = [1.0 + 1e-6] * DEPTH
    fig = plots.gains_figure(
        {"forward_gain": same, "backward_gain": same, "spectral_norm": same}, title="t", step=5
    )
    for ax in fig.axes:
        lines = [line for line in ax.get_lines() if len(line.get_xdata()) == DEPTH]
        assert len(lines) == 3
        # Same data: the markers must differ in shape and size (open circle around smaller filled ones).
        assert len({line.get_marker() for line in lines}) == 3
        assert len({line.get_markersize() for line in lines}) == 3
        assert len({line.get_linestyle() for line in lines}) == 3


def test_gains_exactly_one_says_so():
    ones = [1.0] * DEPTH
    fig = plots.gains_figure(
        {"forward_gain": ones, "backward_gain": ones, "spectral_norm": ones}, title="r", step=9
    )
    _, ax_dev = fig.axes
    assert ax_dev.get_lines() == []
    assert any("exactly 1" in t.get_text() for t in ax_dev.texts)
    assert all("exactly 1" in t.get_text() for t in fig.axes[0].get_legend().get_texts())


def test_large_gains_use_a_log_axis(tmp_path):
    read_png(plots.plot_gains(hc_gains(), title="hc (n=4)", step=1750, path=tmp_path / "hc.png"))
    fig = plots.gains_figure(hc_gains(), title="hc (n=4)", step=1750)
    assert len(fig.axes) == 1 and fig.axes[0].get_yscale() == "log"
    assert len(fig.axes[0].get_lines()) == 4  # three series and the reference at 1


def test_gains_with_nonfinite_values_and_no_spectral_norm(tmp_path):
    g = hc_gains()
    del g["spectral_norm"]
    g["forward_gain"][-1] = float("inf")
    g["backward_gain"][3] = float("nan")
    read_png(plots.plot_gains(g, title="blown up", step=None, path=tmp_path / "g.png"))
    fig = plots.gains_figure(g, title="blown up", step=None)
    assert "step not recorded" in fig.axes[0].get_title()


@pytest.mark.parametrize(
    "gains, match",
    [
        ({"forward_gain": [1.0], "backward_gain": [1.0, 1.0]}, "one length"),
        ({"forward_gain": [], "backward_gain": []}, "non-empty"),
        ({"forward_gain": [1.0]}, "missing 'backward_gain'"),
        ({"forward_gain": [1.0], "backward_gain": [1.0], "spectral": [1.0]}, "unknown key"),
    ],
)
def test_bad_gains_are_refused(gains, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        plots.plot_gains(gains, title="t", step=1, path=tmp_path / "g.png")
    assert not (tmp_path / "g.png").exists()


def test_bad_inputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\.png"):
        plots.plot_gains(mhc_gains(), title="t", step=1, path=tmp_path / "g.svg")
    with pytest.raises(ValueError, match="'loss'"):
        plots.loss_figure([{"step": 1, "tokens": 10, "los": 2.0}], [], title="t", unigram_entropy=None)
    with pytest.raises(ValueError, match="unigram_entropy"):
        plots.loss_figure([], [], title="t", unigram_entropy=float("nan"))
    with pytest.raises(ValueError, match="evals"):
        plots.comparison_figure({"mhc": {"evals": eval_records()}})
    with pytest.raises(ValueError, match="non-empty"):
        plots.comparison_figure({})


def comparison_runs():
    runs = {}
    for i, (name, gains) in enumerate((("residual", None), ("hc", hc_gains()), ("mhc", mhc_gains()))):
        ev = [dict(r, val_loss=r["val_loss"] + 0.01 * i) for r in eval_records()]
        runs[name] = {"variant": name, "train": train_records(bad=(5,)), "eval": ev, "gains": gains,
                      "gains_step": 600, "unigram_entropy": 6.7}  # fmt: skip
    runs["residual"]["gains"] = {k: [1.0] * DEPTH for k in ("forward_gain", "backward_gain", "spectral_norm")}
    runs["mhc-2"] = {"variant": "mhc", "eval": runs["mhc"]["eval"], "gains": mhc_gains()}
    runs["lite"] = {"variant": "mhc-lite", "eval": eval_records()}
    return runs


def test_plot_comparison_every_run_visible(tmp_path):
    runs = comparison_runs()
    read_png(plots.plot_comparison(runs, path=tmp_path / "compare.png"))
    fig = plots.comparison_figure(runs)
    ax_loss, ax_zoom, ax_gain, ax_dev = fig.axes
    val = {line.get_label().split(":")[0]: line for line in ax_loss.get_lines() if line.get_label()[0] != "_"}
    assert set(runs) <= set(val)
    assert val["residual"].get_color() == plots.VARIANT_COLORS["residual"]
    assert val["hc"].get_color() == plots.VARIANT_COLORS["hc"]
    assert val["mhc"].get_color() == val["mhc-2"].get_color() == plots.VARIANT_COLORS["mhc"]
    assert val["mhc"].get_marker() != val["mhc-2"].get_marker()  # same variant, still two lines
    assert val["lite"].get_color() not in plots.VARIANT_COLORS.values()
    # The zoom holds every run's late val points and its y range is set by them alone.
    zoom = {line.get_label(): line for line in ax_zoom.get_lines()}
    assert set(zoom) == set(runs)
    lo, hi = ax_zoom.get_ylim()
    assert all(lo < y < hi for line in zoom.values() for y in line.get_ydata())
    assert hi < 3.5  # the first-half points (val >= 3.5) and the train EMA (up to 9) are left out
    # Gains: HC on a log axis, the near-1 runs apart on the |gain - 1| panel (residual is exactly 1).
    assert ax_gain.get_yscale() == "log" and ax_dev.get_yscale() == "log"
    assert (
        len([line for line in ax_dev.get_lines() if len(line.get_xdata()) == DEPTH]) == 6
    )  # hc, mhc, mhc-2 x 2
    legend = [t.get_text() for t in ax_dev.get_legend().get_texts()]
    # mhc-2 has no gains_step, so each legend entry names its own step instead of the title.
    assert "residual fwd: exactly 1 at depth 24, step 600" in legend, legend
    assert "mhc-2 bwd: 1 + 1.4e-06 at depth 24, step ?" in legend, legend
    assert "step" not in ax_gain.get_title()
    same_step = {k: v for k, v in runs.items() if k in ("residual", "hc", "mhc")}
    assert "at step 600" in plots.comparison_figure(same_step).axes[2].get_title()


def test_comparison_without_gains_or_evals(tmp_path):
    read_png(
        plots.plot_comparison({"a": {"eval": []}, "b": {"train": train_records()}}, path=tmp_path / "c.png")
    )
    fig = plots.comparison_figure({"a": {"eval": []}})
    assert any("no composite gains" in t.get_text() for t in fig.axes[-1].texts)


def test_output_is_deterministic_and_carries_no_version(tmp_path):
    a = plots.plot_gains(mhc_gains(), title="mhc", step=3, path=tmp_path / "a.png").read_bytes()
    b = plots.plot_gains(mhc_gains(), title="mhc", step=3, path=tmp_path / "b.png").read_bytes()
    assert a == b
    assert b"Software" not in a and b"atplotlib" not in a


def test_ema_matches_the_definition():
    rng = np.random.default_rng(0)
    v = rng.normal(size=50)
    beta = 0.9
    m, ref = 0.0, []
    for t, x in enumerate(v, 1):
        m = beta * m + (1 - beta) * x
        ref.append(m / (1 - beta**t))
    np.testing.assert_allclose(plots.ema(v, beta), ref, rtol=1e-12)
    np.testing.assert_allclose(plots.ema([3.0] * 40), 3.0, rtol=1e-12)  # bias correction: no warm-up dip
    with pytest.raises(ValueError, match="NaN"):
        plots.ema([1.0, float("nan")])
    with pytest.raises(ValueError, match="beta"):
        plots.ema([1.0], beta=1.0)


def test_variant_colors_are_stable_and_distinct():
    a = plots.variant_colors(["x1", "x2", "x3", "mhc"])
    b = plots.variant_colors(["mhc", "x3", "x2", "x1"])
    assert a == b
    assert len(set(a.values())) == 4


def test_import_mhc_does_not_import_matplotlib():
    code = "import sys, mhc; assert 'matplotlib' not in sys.modules, sorted(m for m in sys.modules if 'matplotlib' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_mhc_train_does_not_import_matplotlib():
    """Only drawing a figure imports matplotlib: not `import mhc.train`, nor a run with plots=false."""
    code = "import sys, mhc.train; assert 'matplotlib' not in sys.modules, sorted(m for m in sys.modules if 'matplotlib' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


def write_run_files(run_dir, variant, gains, steps=600):
    """A finished run's metrics.jsonl and summary.json, as mhc.train.train writes them."""
    import json

    run_dir.mkdir(parents=True)
    final = {"kind": "final", "step": steps, "variant": variant}
    recs = train_records(bad=(5, 8)) + eval_records() + [final]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {"variant": variant, "n_streams": 4, "steps": steps, "unigram_entropy": 6.7, "composite_gains": gains,
               "params": 1e6, "tokens": steps * TOKENS_PER_STEP, "train_time_s": 10.0, "tokens_per_s": 1e5,
               "final_val_loss": 2.5, "loss_spikes": 0, "max_grad_norm": 1.0, "fwd_gain_full_depth": None,
               "bwd_gain_full_depth": None, "fwd_gain_max": None, "bwd_gain_max": None, "tokenizer": "byte",
               "vocab_size": 257, "device": "cpu", "precision": "fp32"}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return recs


def test_run_plots_are_the_plots_module_figures(tmp_path):
    """plot_run and write_comparison draw their files with mhc.train.plots, from the run's own records."""
    from mhc.train import plot_run, write_comparison

    recs = write_run_files(tmp_path / "mhc", "mhc", mhc_gains())
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [p.name for p in plot_run(tmp_path / "mhc")] == ["loss.png", "gains.png"]
    expect = plots.plot_loss(train, evals, title="mhc (n=4)", unigram_entropy=6.7, path=tmp_path / "loss.png")
    assert (tmp_path / "mhc" / "loss.png").read_bytes() == expect.read_bytes()
    expect = plots.plot_gains(mhc_gains(), title="mhc (n=4)", step=600, path=tmp_path / "gains.png")
    assert (tmp_path / "mhc" / "gains.png").read_bytes() == expect.read_bytes()
    write_run_files(tmp_path / "residual", "residual", None)
    assert [p.name for p in plot_run(tmp_path / "residual")] == ["loss.png"]  # no mHC sites: no gains figure
    assert not (tmp_path / "residual" / "gains.png").exists()

    write_comparison(
        {"residual": tmp_path / "residual", "mhc": tmp_path / "mhc", "gone": tmp_path / "nope"},
        tmp_path / "cmp",
    )
    run = {"train": train, "eval": evals, "gains_step": 600, "unigram_entropy": 6.7}
    expect = plots.plot_comparison(
        {"residual": {**run, "variant": "residual", "gains": None}, "mhc": {**run, "variant": "mhc", "gains": mhc_gains()},
         "gone": {}},
        path=tmp_path / "compare.png",
    )  # fmt: skip
    assert (tmp_path / "cmp" / "compare.png").read_bytes() == expect.read_bytes()
