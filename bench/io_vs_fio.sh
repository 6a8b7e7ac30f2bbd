#!/usr/bin/env bash
# tierflow's I/O engine beside fio at its best: `tierflow bench io` and fio
# (ioengine=io_uring, direct=1, with the same registered buffers and files,
# the same huge-page memory and the same submission batching tierflow uses)
# run alternately on the same file with the same block size and queue depth,
# PAIRS pairs per workload (the order flips every pair, so drift in the device
# favours neither). Each pair runs fio
# in each of its variants: with tierflow's batching and with fio's own default
# (one SQE at a time), and with --sqpoll also without the polling thread (on a
# machine with few CPUs fio's polling thread costs it more than it saves), and
# tierflow is held to the fastest. The median and the spread of the per-pair
# ratios are printed.
#
#   bench/io_vs_fio.sh [--tierflow BIN] [--dir DIR] [--size 1G] [--pairs 9]
#                      [--seq-io-size 2G] [--random-io-size 256M]
#                      [--submit-batch 8] [--sqpoll]
#                      [--workloads seqread,seqwrite,randread]
#
# The file is --size; sequential runs move --seq-io-size (wrapping around the
# file, as fio's io_size does) so each run lasts seconds, not a fraction of one:
# a virtual disk's bandwidth swings a lot from one second to the next.
# --submit-batch N is tierflow's --submit-batch and fio's iodepth_batch_submit
# (0: the whole queue at once, in both); --sqpoll runs tierflow with --sqpoll
# and fio with sqthread_poll. tierflow's run must be O_DIRECT, as fio's is.
# Taking the fastest of several fio runs favours fio on a noisy device: the
# maximum of noisy draws sits above their typical value.
#
# Workloads (each held to 0.95x fio's best):
#   seqread   1 MiB sequential reads,  queue depth 32, bandwidth
#   seqwrite  1 MiB sequential writes, queue depth 32, bandwidth
#   randread  4 KiB random reads,      queue depth 64, IOPS
# Needs fio and jq (scripts/setup.sh installs both).
set -euo pipefail
shopt -s inherit_errexit  # a failed run inside $(...) stops the script too
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tierflow=$here/build/bin/tierflow
dir=${TMPDIR:-/var/tmp}
size=1G
pairs=9
seq_io_size=2G
random_io_size=256M
submit_batch=8
sqpoll=0
workloads=seqread,seqwrite,randread
target=0.95
while (($#)); do
  case $1 in
    --tierflow) tierflow=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --pairs) pairs=$2; shift 2 ;;
    --seq-io-size) seq_io_size=$2; shift 2 ;;
    --random-io-size) random_io_size=$2; shift 2 ;;
    --submit-batch) submit_batch=$2; shift 2 ;;
    --sqpoll) sqpoll=1; shift ;;
    --workloads) workloads=$2; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "io_vs_fio.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ $submit_batch =~ ^[0-9]+$ ]] || { echo "io_vs_fio.sh: --submit-batch '$submit_batch' is not a whole number" >&2; exit 2; }
[[ $pairs =~ ^[1-9][0-9]*$ ]] || { echo "io_vs_fio.sh: --pairs '$pairs' is not a positive whole number" >&2; exit 2; }
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

# What tierflow's engine does, asked of fio too: registered buffers and file
# descriptors, and the kernel's submission-queue polling thread with --sqpoll.
# And the same memory: tierflow's buffers sit in transparent huge pages, so
# fio's are aligned to 2 MiB and its malloc asks for huge pages too (in
# scattered 4 KiB pages a 1 MiB request is 256 segments, which a virtio disk
# without indirect descriptors takes one at a time). Only fio's environment
# gets the glibc tunable: tierflow runs with the memory it allocates itself.
fio_common=(--ioengine=io_uring --direct=1 --numjobs=1 --fixedbufs --registerfiles --iomem_align=2M)
fio_env=(GLIBC_TUNABLES=glibc.malloc.hugetlb=1${GLIBC_TUNABLES:+:$GLIBC_TUNABLES})
tierflow_common=(--backend uring --submit-batch "$submit_batch")
((sqpoll)) && tierflow_common+=(--sqpoll)
# fio's variants, "label:options": tierflow's batching (iodepth_batch_submit =
# --submit-batch; fio reads 0 as the whole queue, as tierflow does), fio's
# default of 1, each with sqthread_poll under --sqpoll, and then also fio's
# best batching without it.
batches=("$submit_batch")
[[ $submit_batch == 1 ]] || batches+=(1)
fio_variants=()
for b in "${batches[@]}"; do
  if ((sqpoll)); then fio_variants+=("sqpoll batch $b:--sqthread_poll=1 --iodepth_batch_submit=$b")
  else fio_variants+=("batch $b:--iodepth_batch_submit=$b"); fi
done
((sqpoll)) && fio_variants+=("batch $submit_batch:--iodepth_batch_submit=$submit_batch")

# run_fio RW BS QD IO_SIZE VARIANT_OPTIONS → bytes/s and IOPS
run_fio() {
  local -a variant
  read -ra variant <<<"$5"
  env "${fio_env[@]}" fio --name=peer --filename="$file" --size="$size" --io_size="$4" --bs="$2" --iodepth="$3" \
      --rw="$1" "${fio_common[@]}" "${variant[@]}" --output-format=json |
    jq -r --arg rw "${1#rand}" '.jobs[0][$rw] | "\(.bw_bytes) \(.iops)"'
}
# run_tierflow RW BS QD IO_SIZE → bytes/s and IOPS; fails unless the run was O_DIRECT
run_tierflow() {
  local out
  out=$("$tierflow" bench io --path "$file" --size "$size" --io-size "$4" --block-size "$2" --queue-depth "$3" \
      --pattern "$1" "${tierflow_common[@]}" --json) ||
    { echo "io_vs_fio.sh: $tierflow bench io failed (rw=$1 bs=$2 iodepth=$3)" >&2; return 1; }
  if [[ $(jq -r '.direct' <<<"$out") != true ]]; then
    echo "io_vs_fio.sh: tierflow's run on $file was not O_DIRECT (the page cache served it); fio runs direct=1, so the two cannot be compared" >&2
    return 1
  fi
  jq -r '"\(.bytes_per_second) \(.iops)"' <<<"$out"
}
# metric "BW IOPS" → the number the workload is judged by
metric_of() { read -r bw iops <<<"$1"; [[ $metric == bandwidth ]] && echo "$bw" || echo "$iops"; }
show() { [[ $metric == bandwidth ]] && awk -v x="$1" 'BEGIN {printf "%8.1f MiB/s", x / 1048576}' ||
                                       awk -v x="$1" 'BEGIN {printf "%8.0f IOPS ", x}'; }

# Each result is assigned before it is used, so that a failed run stops the
# script (set -e does not see a failure inside a nested substitution).
run_fios() {
  local v out
  for v in "${fio_variants[@]}"; do
    out=$(run_fio "$rw" "$bs" "$qd" "$io_size" "${v#*:}")
    fio_runs+=("$(metric_of "$out")")
  done
}
run_tierflow_once() {
  local out
  out=$(run_tierflow "$rw" "$bs" "$qd" "$io_size")
  t=$(metric_of "$out")
}

echo "tierflow vs fio $(fio --version) on $file ($size), $pairs pairs per workload, $(nproc) CPUs"
echo "both: io_uring, O_DIRECT, registered buffers (in huge pages) and files; tierflow: submit batch $submit_batch$( ((sqpoll)) && echo ', SQPOLL')"
status=0
IFS=, read -ra chosen <<<"$workloads"
for w in "${chosen[@]}"; do
  case $w in
    seqread)  rw=read;     bs=1M; qd=32; io_size=$seq_io_size; metric=bandwidth ;;
    seqwrite) rw=write;    bs=1M; qd=32; io_size=$seq_io_size; metric=bandwidth ;;
    randread) rw=randread; bs=4K; qd=64; io_size=$random_io_size; metric=iops ;;
    *) echo "io_vs_fio.sh: unknown workload $w" >&2; exit 2 ;;
  esac
  echo
  echo "== $w: rw=$rw bs=$bs iodepth=$qd io_size=$io_size ($metric)"
  ratios=()
  for ((i = 1; i <= pairs; i++)); do
    fio_runs=()
    if ((i % 2)); then
      run_fios; run_tierflow_once
    else
      run_tierflow_once; run_fios
    fi
    best=$(printf '%s\n' "${fio_runs[@]}" | sort -g | tail -1)
    ratio=$(awk -v a="$t" -v b="$best" 'BEGIN {printf "%.3f", a / b}')
    line="  pair $i:"
    for k in "${!fio_variants[@]}"; do line+="  fio ${fio_variants[k]%%:*} $(show "${fio_runs[k]}")"; done
    printf '%s   tierflow %s   ratio to fio'"'"'s best %s\n' "$line" "$(show "$t")" "$ratio"
    ratios+=("$ratio")
  done
  med=$(printf '%s\n' "${ratios[@]}" | median)
  low=$(printf '%s\n' "${ratios[@]}" | sort -g | head -1)
  high=$(printf '%s\n' "${ratios[@]}" | sort -g | tail -1)
  verdict=$(awk -v m="$med" -v t="$target" 'BEGIN {print (m >= t ? "meets" : "BELOW")}')
  [[ $verdict == meets ]] || status=1
  printf '  median ratio tierflow/fio best: %.3f (spread %.3f..%.3f; %s the %.2fx target)\n' \
    "$med" "$low" "$high" "$verdict" "$target"
done
exit $status
