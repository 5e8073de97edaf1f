"""The token mixers: one file per mixer, looked up by name in registry.py (`build_mixer`).

Every mixer is an `nn.Module` with
  init_state(batch, device, dtype) -> dict[str, Tensor]   its recurrent state, batched on dim 0
  forward(x, state, pos) -> (y, state)    chunked/parallel form over x (B, T, D); prefill and training
  step(x, state, pos) -> (y, state)       one token, x (B, D); decode
  naive(x, state, pos) -> (y, state)      the token-loop reference the tests hold the others to
                                          (the recurrences from model/ops/naive.py)
`state=None` in `forward` means "from zero and do not return a state" (training).
`pos` (B,) int64 is each row's position before these tokens; only position-aware mixers read it.
`owns_norms = True`: the mixer is the whole block, norms included (RWKV-4); the LM adds its output
to the residual stream and applies no norm before it.
`carries = True`: the forms also take `carry=` and return (y, state, carry), a value one block
hands the next within the same tokens (RWKV-7's first-block values, fla_rwkv7.py); no state.
`time_dims` names state tensors that grow with the sequence (the KV cache) and the dim they grow on.
`name` is the mixer's name in configs (`layer_mixers`) and in registry.py's table.

Each file's docstring cites its paper, writes the recurrence out and names its kernels in
model/ops/ (whose __init__ lists every op, its reference and its test). tests/model/test_mixers.py
holds every mixer's three forms together (outputs and final state); tests/model/test_fla.py the
fla_* mixers against fla's own checkpoints.
"""
