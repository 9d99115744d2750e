# bench gated_delta_rule with every peer in one run (main as it lands; carry .peers)
bash tools/gpu_pending.sh gdr-bench
