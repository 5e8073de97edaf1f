"""benchmarks/peers/host.py: the CPU read from /proc/cpuinfo on the three kinds of machine the
peer benchmarks run on, the choice to run llama.cpp without repacking, and the retry after an abort."""
import pytest

from benchmarks.peers.host import FLAGS, Repack, RepackAborted, aborted_on_repack, check_output, cpu_info, needs_no_repack


def cpuinfo(model: str, flags: str, cores: int = 2) -> str:
    """/proc/cpuinfo's text: a block per core (only the first block's model and flags are read)."""
    block = "processor\t: {i}\nvendor_id\t: X\nmodel name\t: {model}\nflags\t\t: {flags}\nbugs\t\t: sysret_ss_attrs\n"
    return "\n".join(block.format(i=i, model=model, flags=flags) for i in range(cores))


BASE = "fpu vme de pse tsc msr pae mce cx8 apic sep sse sse2 ht syscall nx lm pni ssse3 fma cx16 sse4_1 sse4_2 avx f16c"
EPYC_AVX2 = cpuinfo("AMD EPYC 7B12", BASE + " bmi1 avx2 smep bmi2 sha_ni clwb")
EPYC_AVX512 = cpuinfo("AMD EPYC", BASE + " bmi1 avx2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 "
                                         "avx512vbmi avx512_vbmi2 gfni avx512_vnni avx512_bitalg avx512_vpopcntdq")
XEON_AMX = cpuinfo("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
                   BASE + " avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx_vnni avx512_bf16 avx512_vnni "
                          "avx512_bitalg avx512_fp16 amx_bf16 amx_tile amx_int8")


@pytest.mark.parametrize("text, model, flags, no_repack", [
    (EPYC_AVX2, "AMD EPYC 7B12", ["avx2"], False),
    (EPYC_AVX512, "AMD EPYC", ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"], False),
    (XEON_AMX, "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", list(FLAGS), True),
])
def test_cpu_and_repack_choice(text, model, flags, no_repack):
    cpu = cpu_info(text)
    assert cpu == {"model": model, "flags": flags}
    assert needs_no_repack(cpu) is no_repack
    assert Repack.for_cpu(cpu).no_repack is no_repack
    assert Repack.for_cpu(cpu).server_args() == (["--no-repack"] if no_repack else [])
    assert Repack.for_cpu(cpu).bench_args() == (["--repack", "0"] if no_repack else [])


def test_one_amx_flag_is_enough():
    assert needs_no_repack({"model": "x", "flags": ["amx_int8"]})
    assert not needs_no_repack(cpu_info("model name : x\nflags : avx512f amx_tile\n"))


ABORTED = """llama_model_loader: - type  f32:   38 tensors
llama_model_loader: - type q8_0:   19 tensors
load_tensors:   CPU_REPACK model buffer size =     2.25 MiB
load_tensors:          AMX model buffer size =     1.12 MiB
llama_context: constructing llama_context
/src/llama.cpp/ggml/src/ggml-backend.cpp:1294: GGML_ASSERT(*cur_backend_id != -1) failed
/build/bin/llama-bench(+0x1a2b3c)[0x55d0c2e1fb3c]
/lib/x86_64-linux-gnu/libc.so.6(abort+0xd3)[0x7f0e1c2288ff]
"""
OTHER_FAILURE = """llama_model_load: error loading model: missing tensor 'blk.0.ssm_a'
llama_model_load_from_file_impl: failed to load model
main: error: failed to load model 'm.gguf'
"""


def test_abort_detection():
    assert aborted_on_repack(ABORTED) and not aborted_on_repack(OTHER_FAILURE)
    with pytest.raises(RepackAborted, match=r"llama-bench aborted: .*GGML_ASSERT\(\*cur_backend_id != -1\) failed"):
        check_output(ABORTED, "llama-bench")
    check_output(OTHER_FAILURE, "llama-bench")  # another failure is the caller's to report


def test_retried_once_without_repacking(capsys):
    repack = Repack.for_cpu(cpu_info(EPYC_AVX512))
    seen = []

    def attempt():
        seen.append(repack.server_args())
        if not repack.no_repack:
            check_output(ABORTED, "llama-server")
        return "ran"
    assert repack.retrying(attempt) == "ran"
    assert seen == [[], ["--no-repack"]]
    assert repack.no_repack and "retried without repacking" in repack.why
    assert "retrying with repacking off" in capsys.readouterr().out
    assert repack.retrying(attempt) == "ran" and seen[-1] == ["--no-repack"]  # later runs: off from the start


def test_abort_without_repacking_is_not_retried():
    repack = Repack.for_cpu(cpu_info(XEON_AMX))
    calls = []

    def attempt():
        calls.append(1)
        check_output(ABORTED, "llama-server")
    with pytest.raises(RepackAborted):
        repack.retrying(attempt)
    assert len(calls) == 1
