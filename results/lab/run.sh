#!/usr/bin/env bash
# The lab's runs (docs/lab.md, lab/sheet.md step 4), one at a time, each one's output kept here under a line naming
# the commit, the command and the CPU: the three --preset lab runs, COSTA's with the paper's eq. 8 and vector
# (--gwc_sim dot --bottleneck cls, the sheet's comparison), and CPDAE eager / SEED compiled (docs/lab.md, --compile).
#
#     bash results/lab/run.sh                 # from the repository root; about 25 minutes on 2 cores
#     bash results/lab/run.sh costa-paper     # one of them, by its file's name
set -euo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
here=results/lab
py=${PYTHON:-python}
declare -A runs=(
    [costa]="costa.py --preset lab"
    [costa-paper]="costa.py --preset lab --gwc_sim dot --bottleneck cls"
    [cpdae]="cpdae.py --preset lab"
    [cpdae-eager]="cpdae.py --preset lab --compile false"
    [seed]="seed.py --preset lab"
    [seed-compile]="seed.py --preset lab --compile true"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(costa costa-paper cpdae cpdae-eager seed seed-compile)
cpu=$("$py" -c 'from research import benchmark; print(benchmark.machine("")["cpu"])')
for name in "${names[@]}"; do
    cmd=${runs[$name]}
    out=$(mktemp -d)
    {
        echo "# python $cmd --out_dir RUN   (commit $(git rev-parse --short HEAD), $cpu, $(date -u '+%Y-%m-%d %H:%M UTC'))"
        start=$(date +%s)
        # shellcheck disable=SC2086
        "$py" $cmd --out_dir "$out/run" 2>&1
        echo "wall clock: $(( $(date +%s) - start )) s"
    } > "$here/$name.txt"
    rm -rf "$out"
    tail -3 "$here/$name.txt"
done
