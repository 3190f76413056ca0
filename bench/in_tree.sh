# Sourced by bench/ab_trees.sh and bench/run_gpu_ab.sh, which compare source trees on one machine.
# in_tree NAME TREE LIMIT COMMAND...: COMMAND in TREE's directory on TREE's own packages (its
# nanoeuler_core, ops as nanoeuler_ops and data as nanoeuler_data, ahead on the path) and a kernel
# cache of NAME's own (one per GPU where CUDA_VISIBLE_DEVICES names one), within LIMIT seconds.
in_tree() {
    local name=$1 tree=$2 limit=$3
    shift 3
    local links=/tmp/nanoeuler-trees/$name
    mkdir -p "$links"
    ln -sfn "$tree/nanoeuler_core" "$links/nanoeuler_core"
    ln -sfn "$tree/ops" "$links/nanoeuler_ops"
    ln -sfn "$tree/data" "$links/nanoeuler_data"
    (cd "$tree" && PYTHONPATH="$links" NUMBA_CACHE_DIR="$links.cache${CUDA_VISIBLE_DEVICES:+.$CUDA_VISIBLE_DEVICES}" \
        timeout "$limit" "$@")
}
