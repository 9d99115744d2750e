#!/usr/bin/env bash
# QLoRA on the GPU: the 4-bit tests compiled (against bitsandbytes itself when .bnb/ holds its
# wheel, carried: `mkdir -p .bnb && pip download --no-deps bitsandbytes==0.50.2 -d .bnb`), then
# the dequantisation's speed at Llama-3-8B MLP shapes and a LoRA MLP step on a 4-bit base
# against the same step on the dense base. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/fusetune-gpu-qlora}
mkdir -p "$OUT"
if ls .bnb/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/bnb .bnb/*.whl
  export PYTHONPATH=/tmp/bnb:${PYTHONPATH:-}
fi
export PYTHONPATH=src:${PYTHONPATH:-}
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_quant4.py tests/test_lora.py \
  2>&1 | tee "$OUT/qlora-tests.log"
timeout 200 python3 - <<'PY' 2>&1 | tee "$OUT/qlora-bench.log"
import torch, triton
import fusetune
from fusetune.reference import quant4 as ref

def quantize(dense):
    try:
        import bitsandbytes as bnb
        return bnb.nn.Params4bit(dense.cpu(), requires_grad=False, quant_type="nf4").to("cuda")
    except ImportError:
        import sys; sys.path.insert(0, "tests")
        from test_quant4 import quantize as ours
        return ours(dense)

torch.manual_seed(0)
H, I, N, R = 4096, 14336, 8192, 16
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
dense = [(torch.randn(o, i, device="cuda") / i**0.5).to(torch.bfloat16) for o, i in ((I, H), (I, H), (H, I))]
quantised = [quantize(w) for w in dense]
w4 = quantised[0]
ms = triton.testing.do_bench(lambda: fusetune.dequantize_4bit(w4), warmup=50, rep=300)
print(f"dequantize_4bit {I}x{H} bf16: {ms * 1e3:.1f} us, {2.5 * I * H / ms / 1e6:.0f} GB/s")
x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
def projections(weights):
    return [(w, (torch.randn(R, (H if k < 2 else I), device="cuda") * 0.01).requires_grad_(),
             (torch.randn((I if k < 2 else H), R, device="cuda") * 0.01).requires_grad_(), 2.0)
            for k, w in enumerate(weights)]
for name, weights in (("dense bf16 base", dense), ("4-bit NF4 base", quantised)):
    ps = projections(weights)
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fusetune.lora_mlp(x, *ps, "swiglu")
        y.backward(torch.ones_like(y))
        x.grad = None
        for p in ps:
            p[1].grad = p[2].grad = None
    torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    step(); torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = triton.testing.do_bench(step, warmup=50, rep=500)
    print(f"LoRA MLP {N} tok {H}->{I}->{H} r{R}, {name}: {ms:.2f} ms, peak extra {peak:.3f} GiB")
PY
# The QLoRA training step (tools/bench_qlora.py): HF+PEFT+bitsandbytes against + fusetune.
for shape in llama-3.2-1b llama-8b; do
  for variant in hf fusetune; do
    timeout 150 python3 tools/bench_qlora.py --shape $shape --variant $variant 2>&1 \
      | tee -a "$OUT/qlora-step.log" | grep -E "RESULT|Error" | tail -1
  done
done
