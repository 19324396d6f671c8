cd /work/wt-levers
g() { out=$1; shift; OMP_NUM_THREADS=1 nice -n 10 /work/venv/bin/python _wip/grad_table.py "$@" > _wip/g_$out.txt 2>&1; }
g costa_dot costa -
g costa_cos costa - --gwc_sim cos
g costa_cos_mean costa - --gwc_sim cos --bottleneck mean
g cpdae_literal cpdae -
g cpdae_mean_tau002 cpdae - --rec_reduction mean --cl_tau 0.02
g cpdae_mean_tau002_mean cpdae - --rec_reduction mean --cl_tau 0.02 --bottleneck mean
g costa_dot_mean costa - --bottleneck mean
g cpdae_mean cpdae - --rec_reduction mean
