bash tools/gpu_pending.sh gdr-bench  # carry .peers (the trims in the working tree)
