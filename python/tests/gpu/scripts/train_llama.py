"""A scaled-down Hugging Face Llama (transformers' LlamaForCausalLM: the llama config of
data/traces/make_traces.py at 2 layers, hidden 256), random init with a fixed seed, random
token ids, AdamW, fp32, deterministic algorithms. `python train_llama.py native|stweaver`
prints one JSON line: losses (float.hex, for bitwise comparison), peaks, step time. Under
`python -m stweaver run` stweaver is already installed (any mode) and its optimizer hook marks
iterations."""

import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
mode = sys.argv[1] if len(sys.argv) > 1 else "native"
if mode == "stweaver":
    import stweaver

    stweaver.install("online")

import torch  # noqa: E402
import transformers as tf  # noqa: E402

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

V, HID, LAYERS, HEADS, INTER, B, T = 32000, 256, 2, 4, 688, 4, 128
STEPS = int(os.environ.get("STEPS", "12"))

cfg = tf.LlamaConfig(hidden_size=HID, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     num_key_value_heads=HEADS, intermediate_size=INTER, vocab_size=V,
                     max_position_embeddings=T)
cfg._attn_implementation = "eager"  # the same kernels whatever SDPA backends this build has
model = tf.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.float32)
model.config.use_cache = False
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1)
losses = []
torch.cuda.synchronize()
t0 = time.perf_counter()
for i in range(STEPS):
    ids = torch.randint(0, V, (B, T), generator=gen).cuda()
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
torch.cuda.synchronize()
elapsed = time.perf_counter() - t0
backend = torch.cuda.memory.get_allocator_backend()
info = None
if backend == "stweaver":
    import stweaver

    info = stweaver.stats()
print(
    json.dumps(
        {
            "backend": backend,
            "transformers": tf.__version__,
            "losses": [v.hex() for v in losses],
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "step_ms": elapsed / STEPS * 1e3,
            "stweaver": info,
        }
    )
)
