"""benchmarks/serving/latency.py: the in-process column it adds beside `linstream bench latency`'s
HTTP points (the client command itself never loads a model)."""
from benchmarks.serving.latency import in_process
from tests.helpers import make_checkpoint


def test_in_process_steps_the_checkpoint_at_the_context(tmp_path):
    make_checkpoint(tmp_path, "tiny-linear")
    out = in_process(tmp_path, "linear", 16, 4)
    assert out["step"] == "eager" and 0 < out["ms_median"] <= out["ms_p99"]
