"""A recurrent model's slot pool is sized by max_sessions and by max_state_bytes, whichever allows fewer."""
from linstream.model import WEIGHTS
from linstream.model.footprint import footprint
from linstream.server.core.metrics import Metrics
from linstream.server.core.settings import Settings
from linstream.server.engine.loading import load_engines, state_slots


def test_slots_fit_the_state_budget(capsys):
    engines = load_engines(Settings(models=[str(WEIGHTS / "linear")], max_sessions=64, compile="off"), Metrics())
    eng = next(iter(engines.values()))
    assert eng.slots == 64  # the budget (2 GiB) holds 64 states of the shipped model
    per = footprint(eng.model)["state_bytes_per_session"]
    assert state_slots(eng.model, Settings(max_sessions=64, max_state_bytes=10 * per + per // 2)) == 10
    assert "10 session slots in memory, not 64" in capsys.readouterr().err
    assert state_slots(eng.model, Settings(max_sessions=64, max_state_bytes=1)) == 1  # at least one
    small = load_engines(Settings(models=[str(WEIGHTS / "linear")], max_sessions=64, max_state_bytes=3 * per,
                                  compile="off"), Metrics())
    eng = next(iter(small.values()))
    assert eng.slots == 3 and eng.pool.position.shape[0] == 3  # the pool itself holds 3 rows
