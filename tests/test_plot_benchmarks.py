"""scripts/plot_benchmarks.py renders both plots from the JSON the benchmark scripts write (small runs here)."""

import json

import matplotlib.image
import pytest
from script_modules import load_script as load


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    memory, codec = folder / "memory.json", folder / "codec.json"
    load("bench_memory").main(["--max-frames", "30", "--json", str(memory)])
    load("bench_codec").main(["--small", "--only", "bf16", "rtn-int2", "kivi-int2", "nvfp4", "--json", str(codec)])
    return memory, codec


def test_both_plots_are_written_from_the_benchmark_json(reports, tmp_path):
    memory, codec = reports
    written = load("plot_benchmarks").main(["--memory", str(memory), "--codec", str(codec), "--out", str(tmp_path / "png")])
    assert [p.name for p in written] == ["cache_memory.png", "attention_error.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
        height, width, _ = matplotlib.image.imread(path).shape
        assert height >= 500 and width >= 800


def test_every_series_and_codec_row_is_drawn(reports):
    memory, codec = (json.loads(p.read_text()) for p in reports)
    plot = load("plot_benchmarks")
    lines = plot.memory_figure(memory).axes[0].lines
    assert [line.get_label().split(": ")[0] for line in lines] == [
        f"{s}, {w}" for s in ("bf16", "qvg-int2", "qvg-int4", "nvfp4") for w in ("no window", "window 21, sink 3")]
    assert lines[0].get_label() == "bf16, no window: 1.00x" and lines[2].get_label().startswith("qvg-int2, no window: 7.1")
    assert list(lines[0].get_xdata()) == list(range(3, 31, 3))
    fig = plot.codec_figure(codec)
    for ax in fig.axes:  # bf16 (error 0) cannot sit on a log axis: it is named in the caption instead
        assert [c.get_label() for c in ax.collections] == ["rtn-int2", "kivi-int2", "nvfp4"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["rtn-int2", "kivi-int2", "nvfp4"]
    assert "error 0 (not drawn): bf16" in fig.texts[0].get_text()


def test_asks_for_something_to_plot(capsys):
    with pytest.raises(SystemExit):
        load("plot_benchmarks").main([])
    assert "nothing to plot" in capsys.readouterr().err
