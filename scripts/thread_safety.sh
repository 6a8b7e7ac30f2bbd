#!/usr/bin/env bash
# Runs clang's thread-safety analysis over every C++ translation unit of the
# given modules in a build folder's compile_commands.json, with the flags that
# build uses, and fails on any warning. Nothing is compiled to object code, so
# it costs one parse per file rather than another build.
#
#   scripts/thread_safety.sh [BUILD_DIR [MODULE...]]   (default: build core tiers)
#
# The build may have been made with gcc: its flags are kept except those clang
# does not know, which are dropped (each is probed once). clang-16 is used
# because clang 14 cannot parse libstdc++ 12's <source_location>.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-build}
[[ $dir == /* ]] || dir=$here/$dir
shift || true
modules=("$@")
((${#modules[@]})) || modules=(core tiers)
for m in "${modules[@]}"; do
  [[ -d $here/$m ]] || { echo "thread_safety.sh: no module folder $m/" >&2; exit 1; }
done
db=$dir/compile_commands.json
clang=${CLANGXX:-clang++-16}

command -v "$clang" >/dev/null || {
  echo "thread_safety.sh: $clang not found (scripts/setup.sh installs clang-16)" >&2
  exit 1
}
[[ -f $db ]] || {
  echo "thread_safety.sh: $db not found (configure $dir with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)" >&2
  exit 1
}

# One line per translation unit: directory, file, command (tab-separated).
# .cu files go through nvcc and are left out, as is everything outside the
# modules.
prefixes=$(printf '%s\n' "${modules[@]}" | jq -R --arg root "$here" '$root + "/" + . + "/"' | jq -s .)
mapfile -t units < <(jq -r --argjson prefixes "$prefixes" '
  .[] | select(.file | endswith(".cpp"))
      | select(.file as $f | any($prefixes[]; . as $p | $f | startswith($p)))
      | [.directory, .file, .command] | @tsv' "$db")
((${#units[@]})) || { echo "thread_safety.sh: no sources of ${modules[*]} in $db" >&2; exit 1; }

# Whether clang accepts FLAG without a warning; cached per flag.
declare -A accepted=()
clang_accepts() {
  local flag=$1
  if [[ -z ${accepted[$flag]+x} ]]; then
    if "$clang" -Werror "$flag" -fsyntax-only -x c++ /dev/null >/dev/null 2>&1; then
      accepted[$flag]=1
    else
      accepted[$flag]=0
      echo "thread_safety.sh: dropping $flag (unknown to $clang)"
    fi
  fi
  [[ ${accepted[$flag]} == 1 ]]
}

# The clang command for one unit, NUL-separated, written to a file per unit so
# that xargs can run them in parallel.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
n=0
for line in "${units[@]}"; do
  IFS=$'\t' read -r unit_dir file command <<<"$line"
  # compile_commands.json holds each command as the build runs it through sh.
  eval "set -- $command"
  shift  # the compiler
  args=()
  while (($#)); do
    case $1 in
      -o | -MF | -MT | -MQ) shift ;;  # outputs: nothing is written
      -c | -MD | -MMD | "$file") ;;
      -I* | -D* | -U* | -isystem | -std=* | -f* | -W* | -m* | -O* | -g* | -pthread)
        if [[ $1 == -isystem ]]; then
          args+=("$1" "$2")
          shift
        elif clang_accepts "$1"; then
          args+=("$1")
        fi
        ;;
      *) clang_accepts "$1" && args+=("$1") ;;
    esac
    shift
  done
  printf '%s\0' "$unit_dir" "$clang" "${args[@]}" -fsyntax-only -Wthread-safety -Werror "$file" \
    >"$work/$n.cmd"
  n=$((n + 1))
done

# Each unit's diagnostics are printed in one piece, so parallel runs do not
# interleave them.
run_one() {
  local cmd=() out
  mapfile -d '' -t cmd <"$1"
  if ! out=$(cd "${cmd[0]}" && "${cmd[@]:1}" 2>&1); then
    printf '%s\n' "$out" >&2
    return 1
  fi
}
export -f run_one

echo "thread_safety.sh: ${modules[*]}: $n translation units, $clang -Wthread-safety -Werror"
if ! printf '%s\0' "$work"/*.cmd | xargs -0 -n1 -P "$(nproc)" bash -c 'run_one "$0"'; then
  echo "thread_safety.sh: the analysis found problems (above)" >&2
  exit 1
fi
echo "thread_safety.sh: no warnings"
