#!/usr/bin/env bash
# tierflow's I/O engine beside fio: `tierflow bench io` and fio (ioengine=io_uring,
# direct=1) run alternately on the same file with the same block size and queue
# depth, PAIRS pairs per workload (the order flips every pair, so drift in the
# device favours neither), and the median of the per-pair ratios is printed.
#
#   bench/io_vs_fio.sh [--tierflow BIN] [--dir DIR] [--size 1G] [--pairs 9]
#                      [--seq-io-size 2G] [--random-io-size 256M]
#                      [--workloads seqread,seqwrite,randread]
#
# The file is --size; sequential runs move --seq-io-size (wrapping around the
# file, as fio's io_size does) so each run lasts seconds, not a fraction of one:
# a virtual disk's bandwidth swings a lot from one second to the next.
#
# Workloads (and the ratio each is held to):
#   seqread   1 MiB sequential reads,  queue depth 32, bandwidth  (target >= 1.00x fio)
#   seqwrite  1 MiB sequential writes, queue depth 32, bandwidth  (target >= 1.00x fio)
#   randread  4 KiB random reads,      queue depth 64, IOPS       (target >= 0.95x fio)
# Needs fio and jq (scripts/setup.sh installs both).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tierflow=$here/build/bin/tierflow
dir=${TMPDIR:-/var/tmp}
size=1G
pairs=9
seq_io_size=2G
random_io_size=256M
workloads=seqread,seqwrite,randread
while (($#)); do
  case $1 in
    --tierflow) tierflow=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --pairs) pairs=$2; shift 2 ;;
    --seq-io-size) seq_io_size=$2; shift 2 ;;
    --random-io-size) random_io_size=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "io_vs_fio.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for tool in fio jq "$tierflow"; do
  command -v "$tool" >/dev/null || { echo "io_vs_fio.sh: $tool not found" >&2; exit 1; }
done

scratch=$(mktemp -d "$dir/tierflow-vs-fio-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
file=$scratch/data

# Lays the file out once (written, so reads read real blocks), with fio.
fio --name=layout --filename="$file" --size="$size" --bs=1M --rw=write --ioengine=io_uring \
    --direct=1 --iodepth=32 --output-format=json >/dev/null

median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }

# run_fio RW BS QD IO_SIZE → bytes/s and IOPS
run_fio() {
  fio --name=peer --filename="$file" --size="$size" --io_size="$4" --bs="$2" --iodepth="$3" \
      --rw="$1" --ioengine=io_uring --direct=1 --numjobs=1 --output-format=json |
    jq -r --arg rw "${1#rand}" '.jobs[0][$rw] | "\(.bw_bytes) \(.iops)"'
}
# run_tierflow RW BS QD IO_SIZE → bytes/s and IOPS
run_tierflow() {
  "$tierflow" bench io --path "$file" --size "$size" --io-size "$4" --block-size "$2" --queue-depth "$3" \
      --pattern "$1" --backend uring --json | jq -r '"\(.bytes_per_second) \(.iops)"'
}

echo "tierflow vs fio $(fio --version) on $file ($size), $pairs pairs per workload, $(nproc) CPUs"
status=0
IFS=, read -ra chosen <<<"$workloads"
for w in "${chosen[@]}"; do
  case $w in
    seqread)  rw=read;     bs=1M; qd=32; io_size=$seq_io_size; metric=bandwidth; target=1.00 ;;
    seqwrite) rw=write;    bs=1M; qd=32; io_size=$seq_io_size; metric=bandwidth; target=1.00 ;;
    randread) rw=randread; bs=4K; qd=64; io_size=$random_io_size; metric=iops;      target=0.95 ;;
    *) echo "io_vs_fio.sh: unknown workload $w" >&2; exit 2 ;;
  esac
  echo
  echo "== $w: rw=$rw bs=$bs iodepth=$qd io_size=$io_size ($metric)"
  ratios=()
  for ((i = 1; i <= pairs; i++)); do
    if ((i % 2)); then
      f=$(run_fio "$rw" "$bs" "$qd" "$io_size"); t=$(run_tierflow "$rw" "$bs" "$qd" "$io_size")
    else
      t=$(run_tierflow "$rw" "$bs" "$qd" "$io_size"); f=$(run_fio "$rw" "$bs" "$qd" "$io_size")
    fi
    read -r f_bw f_iops <<<"$f"
    read -r t_bw t_iops <<<"$t"
    if [[ $metric == bandwidth ]]; then
      ratio=$(awk -v a="$t_bw" -v b="$f_bw" 'BEGIN {printf "%.3f", a / b}')
      printf '  pair %d: fio %8.1f MiB/s   tierflow %8.1f MiB/s   ratio %s\n' "$i" \
        "$(awk -v x="$f_bw" 'BEGIN {print x / 1048576}')" "$(awk -v x="$t_bw" 'BEGIN {print x / 1048576}')" "$ratio"
    else
      ratio=$(awk -v a="$t_iops" -v b="$f_iops" 'BEGIN {printf "%.3f", a / b}')
      printf '  pair %d: fio %9.0f IOPS    tierflow %9.0f IOPS    ratio %s\n' "$i" "$f_iops" "$t_iops" "$ratio"
    fi
    ratios+=("$ratio")
  done
  med=$(printf '%s\n' "${ratios[@]}" | median)
  verdict=$(awk -v m="$med" -v t="$target" 'BEGIN {print (m >= t ? "meets" : "BELOW")}')
  [[ $verdict == meets ]] || status=1
  printf '  median ratio tierflow/fio: %.3f (%s the %.2fx target)\n' "$med" "$verdict" "$target"
done
exit $status
