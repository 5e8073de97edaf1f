"""The decoder-only LM: embedding, pre-norm blocks of (mixer + MLP), final norm, tied head.

The model computes logits and advances state; it never samples (see sampling.py / generate.py).
  forward(tokens (B, T), state) -> logits (B, T, V), state     chunked form: prefill and training
  step(tokens (B,), state) -> logits (B, V), state             one token per row: decode

Shapes: B batch, T time, D d_model, V vocabulary (here V is the vocabulary, not a head's value dim).
A block's x is (B, T, D) in the chunked forms ('forward', 'naive') and (B, D) in 'step'; each
mixer's state tensors are written in its own file and in state.py.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .config import ModelConfig
from .mixers.registry import build_mixer
from .state import LayerState, State


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight  # (..., D)


class MLP(nn.Module):
    def __init__(self, d: int, ratio: float):
        super().__init__()
        self.up, self.down = nn.Linear(d, int(ratio * d), bias=False), nn.Linear(int(ratio * d), d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))  # (..., D) -> (..., ratio * D) -> (..., D)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: str):
        super().__init__()
        self.mixer = build_mixer(mixer, cfg)
        self.norm1 = None if getattr(self.mixer, "owns_norms", False) else RMSNorm(cfg.d_model, cfg.norm_eps)
        # mlp_ratio 0: no MLP, as in Mamba checkpoints, whose blocks are norm + mixer alone
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.mlp_ratio else None
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio) if cfg.mlp_ratio else None

    def forward(self, x: Tensor, state: LayerState | None, pos: Tensor | None, form: str,
                carry: Tensor | None = None) -> tuple[Tensor, LayerState | None, Tensor | None]:
        """-> (x, state, carry): carry is what a `carries` mixer hands the next block (None otherwise).
        x (B, T, D) for 'forward' and 'naive', (B, D) for 'step'; the output has x's shape."""
        run, h = getattr(self.mixer, form), x if self.norm1 is None else self.norm1(x)
        if getattr(self.mixer, "carries", False):
            y, state, carry = run(h, state, pos, carry=carry)
        else:
            y, state = run(h, state, pos)
        x = x + y
        if self.mlp is not None and self.norm2 is not None:  # both or neither (mlp_ratio)
            x = x + self.mlp(self.norm2(x))
        return x, state, carry  # x's shape


class LM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, m) for m in cfg.layer_mixers)
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.norm == "layer" else RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self._fingerprint: str | None = None
        self._num_params: int | None = None  # set when projections become int8 buffers (model/compiled/lowp.py)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def num_params(self) -> int:
        """The checkpoint's parameter count (an int8 model counts the weights it was made from)."""
        return self._num_params if self._num_params is not None else sum(p.numel() for p in self.parameters())

    def init_state(self, batch: int = 1) -> State:
        # float32 whatever the weights' dtype: a recurrent state is a running sum over the whole
        # context, and bfloat16's 8-bit mantissa drops increments below 1/256 of it (the mixers
        # that run in lower precision carry their recurrence out in float32, see mamba.py)
        dev, dt = self.embed.weight.device, torch.float32
        return State([b.mixer.init_state(batch, dev, dt) for b in self.blocks],
                     torch.zeros(batch, dtype=torch.long, device=dev),
                     [dict(b.mixer.time_dims) for b in self.blocks],
                     torch.zeros(batch, self.cfg.vocab_size, device=dev, dtype=dt))

    def forward(self, tokens: Tensor, state: State | None = None, form: str = "forward",
                last_only: bool = False) -> tuple[Tensor, State | None]:
        """tokens (B, T). form 'forward' is the chunked/parallel path; 'naive' the token loop.
        With state=None the pass starts from zero and returns no state (training). last_only:
        the logits of the last position only, (B, 1, V) (a prompt's prefill needs no others: the
        head is the largest projection, and it would run over every position)."""
        x = self.embed(tokens.to(self.embed.weight.device))  # (B, T, D)
        pos = None if state is None else state.position  # (B,) each row's position before these tokens
        new, carry = [], None  # carry: within these tokens, from block to block (model/mixers/__init__.py)
        for i, block in enumerate(self.blocks):
            x, s, carry = block(x, None if state is None else state.layers[i], pos, form, carry)  # (B, T, D)
            new.append(s)
        if last_only:
            x = x[:, -1:]  # (B, 1, D)
        logits = self.head(self.norm(x)).float()  # (B, T, V); sampled in float32 whatever the weights
        if state is None:
            return logits, None
        if tokens.shape[1] == 0:
            return logits, state
        return logits, State(new, state.position + tokens.shape[1], state.time_dims, logits[:, -1])

    def step(self, tokens: Tensor, state: State) -> tuple[Tensor, State]:
        """One token per row: tokens (B,), rows may sit at different positions. The state's
        tensors are updated where they lie (the recurrent mixers' S/z/h, the KV caches) or come
        back new (conv tails); either way the returned State holds the result. Keep a copy
        (State.clone) to step from the same state twice."""
        logits, new = self.step_layers(tokens, state.layers, state.position)
        return logits, State(new, state.position + 1, state.time_dims, logits)

    def step_layers(self, tokens: Tensor, layers: list[LayerState], position: Tensor) -> tuple[Tensor, list[LayerState]]:
        """`step` on plain tensors: (logits (B, V) float32, new layers). What model/compiled/stepper.py compiles."""
        x = self.embed(tokens.to(self.embed.weight.device))  # (B, D)
        new, carry = [], None
        for block, layer in zip(self.blocks, layers):
            x, s, carry = block(x, layer, position, "step", carry)  # (B, D)
            new.append(s)
        return self.head(self.norm(x)).float(), new  # (B, V)

    # ---- identity and checkpoints --------------------------------------------------------
    def digest(self) -> str:
        """sha256 of the config and every weight as they are now (the fingerprint keeps the first)."""
        h = hashlib.sha256(self.cfg.to_json().encode())
        for name, t in sorted(self.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    @property
    def fingerprint(self) -> str:
        """The digest when first asked (model/compiled/lowp.py keeps the float32 checkpoint's across a cast):
        a snapshot only loads into the model it came from."""
        if self._fingerprint is None:
            self._fingerprint = self.digest()[:32]
        return self._fingerprint

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(json.loads(self.cfg.to_json()), indent=2) + "\n")
        sd = {k: v.contiguous() for k, v in self.state_dict().items()}
        if self.cfg.tie_embeddings:
            sd.pop("head.weight")
        save_file(sd, str(path / "model.safetensors"))
        if extra is not None:
            (path / "training.json").write_text(json.dumps(extra, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "LM":
        path = Path(path)
        cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
        model = cls(cfg)
        sd = load_file(str(path / "model.safetensors"))
        if cfg.tie_embeddings:
            sd["head.weight"] = sd["embed.weight"]
        model.load_state_dict(sd)
        return model.eval()
