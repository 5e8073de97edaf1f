import atexit
import os
import shutil
import tempfile

import pytest
import torch

from linstream.model.config import PRESETS
from linstream.model.lm import LM

# tests use an in-memory store unless they ask for another (the default is a directory in $HOME)
os.environ.setdefault("LINSTREAM_STORE", "memory")
# and eager decode steps: a compile in the background of every test server would cost each one
# tens of seconds of CPU (tests/model/compiled/ and the tests that start a compiled engine or
# server ask for the compiled path)
os.environ.setdefault("LINSTREAM_COMPILE", "off")
# One compile cache for the run (fresh; LINSTREAM_TEST_COMPILE_CACHE names one to keep between runs):
# each distinct compiled step (an AOTInductor library named by the model's shape, the settings
# and the thread count) and the packed_linear kernel is built once into it, and a second Stepper
# for the same model and options, in the tests, in another pytest-xdist worker or in a test server
# (which inherit the variable), loads it instead of building it again.
if os.environ.get("LINSTREAM_TEST_COMPILE_CACHE"):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["LINSTREAM_TEST_COMPILE_CACHE"]
elif not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("LINSTREAM_RUN_COMPILE_CACHE")):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["LINSTREAM_RUN_COMPILE_CACHE"] = \
        tempfile.mkdtemp(prefix="linstream-test-compile-")  # made by the run's first process, shared by its workers
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
else:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["LINSTREAM_RUN_COMPILE_CACHE"]
# the built step's C++ wrapper compiled at -O0: the tests check what a step computes, not how fast,
# and the wrapper is a large part of each build's compile time (the kernels keep their -O3)
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")

TINY = ["tiny-linear", "tiny-softmax", "tiny-mamba", "tiny-performer", "tiny-retnet", "tiny-gla", "tiny-rwkv",
        "tiny-hybrid"]


@pytest.fixture(params=TINY)
def tiny(request) -> LM:
    torch.manual_seed(0)
    return LM(PRESETS[request.param]).eval()


def random_state(model: LM, batch: int, tokens: int = 13):
    """A non-zero state: the model run over random tokens (KV caches and all)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, tokens), generator=g)
    with torch.no_grad():
        _, s = model(ids, model.init_state(batch))
    return s


@pytest.fixture
def one_thread():
    """Batch invariance is a one-thread property: with more, the BLAS splits a batch's rows
    between threads by its size, and a row's low bits follow the split (eager alike). The
    compiled steps of the `compiled` fixture are built for one thread too (the thread count is
    part of a library's name), so a Stepper or Engine made under this fixture loads them."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def compiled():
    """compiled(model, gemm="own", runtime="aoti") -> the run's one compiled Stepper of that model
    (tests/compiled_steps.py names them) and those options, built for one thread at its first
    request, or loaded once the prebuild process has built it."""
    from tests import compiled_steps
    built = {}

    def get(model: str, gemm: str = "own", runtime: str = "aoti"):
        step = (model, gemm, runtime)
        if step not in built:
            if _prebuild is not None:
                _prebuild.wait(step)
            st = compiled_steps.build(*step)
            assert st.wait(), "the step did not compile"
            built[step] = st
        return built[step]
    return get


_prebuild = None
PREBUILD_BESIDE = 20  # tests that need no compiled step, at least, for the prebuild to run beside them


def pytest_collection_modifyitems(items):
    """A test that needs a compiled step (the `compiled` fixture) or is part of the matrix is slow.
    Tests that need a compiled step run last, so that in a run of more than those the prebuild
    process builds their steps beside the others."""
    for item in items:
        if "compiled" in getattr(item, "fixturenames", ()) or item.get_closest_marker("matrix"):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: "compiled" in getattr(item, "fixturenames", ()))  # (stable)


def pytest_collection_finish(session):
    """Start the prebuild of the default run's steps (tests/compiled_steps.py STEPS) when this run
    has tests that need compiled steps and enough others to build them beside (LINSTREAM_TEST_PREBUILD=0:
    never). Under pytest-xdist the first worker starts it, and the others wait for what it builds."""
    global _prebuild
    from linstream.model.compiled import compiler_missing
    need = sum("compiled" in getattr(item, "fixturenames", ()) for item in session.items)
    if (need and len(session.items) - need >= PREBUILD_BESIDE and compiler_missing() is None
            and os.environ.get("LINSTREAM_TEST_PREBUILD") != "0"):
        from tests.compiled_steps import STEPS, Prebuild, Waiter
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        _prebuild = Prebuild(STEPS) if worker in (None, "gw0") else Waiter(STEPS)


def pytest_sessionfinish(session):
    if _prebuild is not None:
        _prebuild.stop()
