#!/bin/bash
# Every GPU check in one prepared run (a few minutes on one GPU): the CUDA tests, `sbpc check
# --backend cuda` on a dozen models beyond the GPU check's own, `sbpc run` and `sbpc-run` on
# cuda, then bench/gpu_check.py alone (parity, NCCL on one rank, 1.3B speed and MFU).
#   PY=python3 OUT=/tmp/gpu bash bench/gpu_suite.sh      # logs under $OUT
# PARTS picks among "tests extras gpucheck"; GC_ARGS are gpu_check.py's (default --batch 4,
# which fits plan and eager side by side in 80 GB). The tests and the extra checks run side by
# side (CPU-bound compiles), the speed part alone.
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SB="$PY -m sbpc.cli"
echo "== env"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
$PY -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version())" 2>&1 | tail -1
PARTS=${PARTS:-tests extras gpucheck}
if [[ $PARTS == *tests* ]]; then
  ( timeout -k 5 ${T_TESTS:-150} $PY -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py > "$OUT/tests.log" 2>&1
    echo "tests rc=$?" >> "$OUT/tests.log" ) &
fi
if [[ $PARTS == *extras* ]]; then
  ( for m in ${MODELS:-examples/hf_gpt2.py examples/hf_llama.py tests/models/unet_gn.py tests/models/resnet_bn.py \
               tests/models/complex_rotary.py tests/models/megatron_layer.py tests/models/embedding_bag.py \
               tests/models/torch_transformer.py tests/models/alibi_attention.py tests/models/row_pick.py \
               tests/models/random_init.py tests/models/mlp_bn.py tests/models/many_losses.py tests/models/vision_ops.py}; do
      echo "## check $m"; timeout -k 5 45 $SB check $m --backend cuda --steps 2 2>&1 | tail -4; echo "rc=${PIPESTATUS[0]}"
    done
    echo "## run"; $SB compile examples/gpt.py --mesh 1 -o "$OUT/gpt.json" 2>&1 | tail -1
    timeout -k 5 60 $SB run "$OUT/gpt.json" --backend cuda --steps 5 --data stdlib --log-interval 1 --no-progress 2>&1 | tail -8
    echo "rc=${PIPESTATUS[0]}"
    echo "## sbpc-run"; timeout -k 5 60 $PY -m sbpc.runtime.cli "$OUT/gpt.json" --backend cuda --steps 3 2>&1 | tail -5
    echo "rc=${PIPESTATUS[0]}"
  ) > "$OUT/extras.log" 2>&1 &
fi
wait
[[ -f $OUT/tests.log ]] && { echo "== tests"; tail -40 "$OUT/tests.log"; }
[[ -f $OUT/extras.log ]] && { echo "== extras"; grep -E "^##|rc=|PASS|FAIL|rror|largest" "$OUT/extras.log" | cut -c1-400; }
if [[ $PARTS == *gpucheck* ]]; then
  echo "== gpu_check"
  timeout -k 5 ${T_GC:-230} $PY bench/gpu_check.py ${GC_ARGS:---batch 4} 2>&1 | tee "$OUT/gpu_check.log" | cut -c1-600
  echo "gpu_check rc=${PIPESTATUS[0]}"
fi
