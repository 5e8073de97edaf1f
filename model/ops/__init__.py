"""The recurrences the mixers run, one file per family, each with its sequence (chunked) form and
its one-token step side by side; `naive.py` holds the references the tests hold them to, written
from the papers as float32 token loops that share no code with the forms they check.

    file               functions                                what (mixers)                                          test
    conv.py            causal_conv, causal_conv_step            short causal depthwise convolution                     test_ops
    rope.py            rope                                     rotary positions (softmax, retnet)                    test_ops
    decayed_attn.py    decayed_attn_*, linear_attn_*            fixed per-head decay (linear, performer, retnet)       test_ops
    gated_attn.py      gated_attn_*                             per-channel data-dependent decay (gla, rwkv, fla-*)    test_ops
    selective_scan.py  selective_scan, selective_scan_step      Mamba's scan (mamba; prefill: a C++ kernel)            test_ops, test_scan_kernel
    ssd.py             ssd_chunked, ssd_step                    Mamba-2's scalar-decay SSM (mamba2)                    test_ops
    wkv.py             wkv_chunked, wkv_step                    RWKV-4's WKV (rwkv4)                                   test_ops
    delta_rule.py      delta_rule_chunked, delta_rule_step      DeltaNet's delta rule (fla-deltanet)                   test_fla
    rwkv7.py           rwkv7_chunked, rwkv7_step                RWKV-7's generalised delta rule (fla-rwkv7)            test_ops
    naive.py           <name>_naive for each of the above

The attention-style ops keep fla's shape: `op_chunked(q, k, v, g, initial_state=None,
output_final_state=False, chunk_size) -> (o, final_state)` and `op_step(q, k, v, g, state) -> (o, state)`
with B batch, T time, H heads, K key dim, V value dim; the SSM ops keep their papers' letters
(b, l, e, h, p, n), written down in each file. The mixers in `model/mixers/` own the projections,
gates and norms around them. The test column names the file in tests/model/ that holds each form to its reference (outputs and
final state): test_ops.py, and test_fla.py for the delta rule (beside the fla checkpoints that use
it); tests/model/test_mixers.py does the same for whole mixers.
"""
