# branch gdr-walk-k64b: the fault probe with the k64 walks (level auto takes them; fp32 and w
# keep the default walks), B4 T4096 and B2 T700 (strong decays), 2 repeats a case
set -u
FUSETUNE_GDR_WALK=k64 PYTHONPATH=src:tests:tools timeout 230 python3 -u tools/gdr_fault_probe.py \
  matrix --repeats 2 --shapes b4t4096 b2t700 2>&1 | tee $OUT/probe-k64.log
echo "done in $SECONDS s"
