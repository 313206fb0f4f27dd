#!/usr/bin/env python3
"""Trains a multi-token-prediction head for models/coder-mini (the main model
frozen) and writes it as mtp.* tensors beside the model's own weights.

The head predicts token t+2 from the main model's final (normed) hidden state
at t and the embedding of token t+1, at RoPE position t:
  z = fc([norm_e(embed(x[t+1])) | norm_h(h[t])]);  one decoder layer (gated
  full attention over the entries 0..t, then the MoE);  logits =
  lm_head(norm(layer output)).
This is the semantics flashmoe implements (src/backend/cpu/mtp.cpp) and that
vLLM's qwen3_next_mtp uses for published checkpoints.

The decoder layer starts as a copy of the model's first full-attention layer
(the same module class, so its forward is HF's own), fc as [0.01 noise | I],
the norms as copies of the final norm. Training data: Python sources of the
machine's site-packages (as the model's own training script,
train_coder_mini.py), without the held-out eval text.

Writes OUT/coder-mini-mtp/ (a copy of the model directory with
model/mtp.safetensors added) and OUT/mtp_reference.safetensors (golden head
logits, see write_reference), and prints the draft acceptance on held-out code.

usage: train_mtp_head.py MODEL_DIR OUT [SECONDS]
"""
import copy, glob, json, math, os, random, shutil, sys, tempfile, time

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

SRC, OUT = sys.argv[1], sys.argv[2]
BUDGET = float(sys.argv[3]) if len(sys.argv) > 3 else 150
t0 = time.time()
torch.manual_seed(0)
random.seed(0)
dev = "cuda"
log_lines = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    log_lines.append(s)


tok = Tokenizer.from_file(os.path.join(SRC, "tokenizer.json"))
model = AutoModelForCausalLM.from_pretrained(os.path.join(SRC, "model"), dtype=torch.float32).to(dev).eval()
for p in model.parameters():
    p.requires_grad_(False)
cfg = model.config
EOS = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 0
FULL = cfg.layer_types.index("full_attention")
H = cfg.hidden_size
inner = model.model
log(f"model: {type(model).__name__}, hidden {H}, full-attention layer {FULL}, {time.time()-t0:.0f}s")

# ---------------- data ----------------
held = open(os.path.join(SRC, "eval", "code_heldout.txt"), encoding="utf-8").read()
roots = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
files = sorted(set(f for r in roots for f in glob.glob(os.path.join(r, "**", "*.py"), recursive=True)))
random.shuffle(files)
texts, total = [], 0
for f in files:
    try:
        s = open(f, encoding="utf-8").read()
    except Exception:
        continue
    if 200 < len(s) < 200_000 and s[:2000] not in held:
        texts.append(s)
        total += len(s)
    if total > 15_000_000:
        break
ids = []
for i in range(0, len(texts), 512):
    for e in tok.encode_batch(texts[i:i + 512]):
        ids += e.ids + [EOS]
stream = torch.tensor(ids, dtype=torch.long)
held_ids = tok.encode(held).ids
log(f"train tokens {len(stream)/1e6:.1f} M, held-out tokens {len(held_ids)}, {time.time()-t0:.0f}s")


# ---------------- the head ----------------
class MtpHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.cat([0.01 * torch.randn(H, H), torch.eye(H)], 1))
        self.pre_fc_norm_embedding = copy.deepcopy(inner.norm)
        self.pre_fc_norm_hidden = copy.deepcopy(inner.norm)
        self.norm = copy.deepcopy(inner.norm)
        self.layer = copy.deepcopy(inner.layers[FULL])
        for p in self.parameters():
            p.requires_grad_(True)


head = MtpHead().to(dev)
captured = {}


def grab(_module, args, kwargs):
    captured.clear()
    captured.update(kwargs)


hook = inner.layers[FULL].register_forward_pre_hook(grab, with_kwargs=True)


def main_pass(x):
    """Final normed hidden states [B, T, H] and logits; captures the layer kwargs (RoPE, mask)."""
    with torch.no_grad():
        out = inner(input_ids=x, use_cache=False)
        h = out.last_hidden_state
        return h, model.lm_head(h)


def shifted(x):
    """The token each entry reads: x[j+1] (the last entry, which has none, reads EOS)."""
    return torch.cat([x[:, 1:], torch.full_like(x[:, :1], EOS)], 1)


def head_pass(nxt, h):
    """Head output for entries j = 0..T-1 from (h[j], nxt[j]) at position j (main_pass over T tokens first)."""
    e = inner.embed_tokens(nxt)
    z = head.fc(torch.cat([head.pre_fc_norm_embedding(e), head.pre_fc_norm_hidden(h)], -1))
    skip = ("hidden_states", "past_key_values", "past_key_value", "use_cache", "cache_position")
    kw = {k: v for k, v in captured.items() if k not in skip}
    y = head.layer(z, **kw)
    y = y[0] if isinstance(y, tuple) else y
    return head.norm(y)


# ---------------- train ----------------
SEQ, BS, LR = 512, 16, 1e-3
opt = torch.optim.AdamW([p for p in head.parameters()], lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
train_s = BUDGET - (time.time() - t0) - 40
rng = random.Random(1)
step, t_train = 0, time.time()
head.train()
while time.time() - t_train < train_s:
    frac = (time.time() - t_train) / train_s
    for g in opt.param_groups:
        g["lr"] = LR * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
    starts = [rng.randint(0, len(stream) - SEQ - 1) for _ in range(BS)]
    x = torch.stack([stream[s:s + SEQ] for s in starts]).to(dev)
    h, _ = main_pass(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = head_pass(shifted(x), h)
        logits = model.lm_head(y[:, :-2]).float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    if step % 50 == 0:
        log(f"step {step} ce {loss.item():.3f} t {time.time()-t0:.0f}s")
    step += 1
log(f"trained {step} steps ({step*BS*SEQ/1e6:.1f} M tokens), {time.time()-t0:.0f}s")
head.eval()
hook.remove()
hook = inner.layers[FULL].register_forward_pre_hook(grab, with_kwargs=True)

# ---------------- save: the layer's tensors named as the loader reads the model's own ----------------
# The layer is saved through save_pretrained in the full-attention layer's
# place, so its tensors carry whatever names and expert layout the model's own
# checkpoint has; then renamed to mtp.layers.0.*.
dst = os.path.join(OUT, "coder-mini-mtp")
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(SRC, dst)
head_bf16 = copy.deepcopy(head).to(torch.bfloat16)
tmp = tempfile.mkdtemp()
original = inner.layers[FULL]
inner.layers[FULL] = head_bf16.layer
model.to(torch.bfloat16).save_pretrained(tmp)
inner.layers[FULL] = original
model.float()
tensors = {}
for f in glob.glob(os.path.join(tmp, "*.safetensors")):
    with safe_open(f, "pt") as sf:
        for k in sf.keys():
            for pre in (f"model.layers.{FULL}.", f"model.language_model.layers.{FULL}."):
                if k.startswith(pre):
                    tensors["mtp.layers.0." + k[len(pre):]] = sf.get_tensor(k).contiguous()
shutil.rmtree(tmp)
assert tensors, "no layer tensors found in the saved model"
tensors["mtp.fc.weight"] = head_bf16.fc.weight.detach().contiguous()
for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
    tensors[f"mtp.{n}.weight"] = getattr(head_bf16, n).weight.detach().contiguous()
save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(dst, "model", "mtp.safetensors"))
log(f"wrote {dst}/model/mtp.safetensors: {len(tensors)} tensors")

# The reference and the acceptance use the bf16-rounded head, as flashmoe reads it.
head = head_bf16.float()


# ---------------- golden logits and acceptance ----------------
@torch.no_grad()
def write_reference(n=96):
    x = torch.tensor(held_ids[:n], device=dev)[None]
    h, main_logits = main_pass(x)
    y = head_pass(shifted(x), h)
    mtp_logits = model.lm_head(y)[0, :-1]  # entry j predicts x[j+2]; the last entry is padding
    # A second draft step after entry P-1: the head's own output at P-1 and
    # the token it drafted, at position P (the entries before it real).
    P = n // 2
    d1 = int(mtp_logits[P - 1].argmax())
    h2 = torch.cat([h[:, :P], y[:, P - 1:P]], 1)
    nxt2 = torch.cat([x[:, 1:P + 1], torch.tensor([[d1]], device=dev)], 1)
    main_pass(x[:, :P + 1])  # the layer kwargs for P+1 positions
    y2 = head_pass(nxt2, h2)
    step2 = model.lm_head(y2)[0, P]
    save_file({"ids": x[0].long().cpu(), "mtp_logits": mtp_logits.float().cpu().contiguous(),
               "step2_at": torch.tensor([P], dtype=torch.int64), "step2_token": torch.tensor([d1], dtype=torch.int64),
               "step2_logits": step2.float().cpu().contiguous()},
              os.path.join(OUT, "mtp_reference.safetensors"))
    log(f"wrote mtp_reference.safetensors ({n} tokens; second step at position {P})")


@torch.no_grad()
def acceptance(n_seq=16):
    """Teacher-forced greedy acceptance on held-out code: how often the head's
    first draft after position t equals the model's own argmax at t+1."""
    hit = cnt = 0
    for i in range(n_seq):
        j = i * SEQ
        if j + SEQ > len(held_ids):
            break
        x = torch.tensor(held_ids[j:j + SEQ], device=dev)[None]
        h, logits = main_pass(x)
        y = head_pass(shifted(x), h)
        draft = model.lm_head(y)[0, :-2].argmax(-1)
        target = logits[0, 1:-1].argmax(-1)
        hit += int((draft == target).sum())
        cnt += draft.numel()
    return hit / max(cnt, 1)


write_reference()
log(f"held-out code: first-draft greedy acceptance {acceptance():.3f} (teacher-forced)")
log(f"done, {time.time()-t0:.0f}s")
open(os.path.join(OUT, "train_mtp_log.txt"), "w").write("\n".join(log_lines) + "\n")
