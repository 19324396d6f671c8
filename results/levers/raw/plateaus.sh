cd /work/wt-levers
p() { out=$1; shift; OMP_NUM_THREADS=1 nice -n 10 /work/venv/bin/python -W ignore _wip/plateau_heads.py "$@" 2>&1 | grep -v "^minilm\|^data" > _wip/p_$out.txt; }
p costa_cos_cls costa 1e-3,5e-3 200 5 --gwc_sim cos
p costa_cos_mean costa 1e-3,5e-3 200 5 --gwc_sim cos --bottleneck mean
p costa_dot_cls costa 1e-3,5e-3 200 5
p cpdae_tau_mean cpdae 1e-3,5e-3 40 5 --rec_reduction mean --cl_tau 0.02 --bottleneck mean
p seed_cls seed 1e-3,5e-3 40 5
p seed_mean seed 1e-3,5e-3 40 5 --bottleneck mean
p cpdae_lit_cls cpdae 1e-3 40 5
