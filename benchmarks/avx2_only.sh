#!/bin/sh
# Run a command as an AVX2-only x86 CPU would (no AVX-512, AVX512-BF16 or AMX), on a CPU that has them: torch's
# kernels (ATen, oneDNN, MKL) are capped at AVX2 and PACT's NVFP4 kernel is built for Haswell (AVX2 + FMA) instead of
# -march=native. An emulation: the caches, memory bandwidth and clocks stay this machine's, and libraries that pick
# their kernels by cpuid themselves (bitsandbytes' CPU backend) are not capped. Label figures taken with it so.
#
#     sh benchmarks/avx2_only.sh python benchmarks/bench_main_job.py --dtype float32 --output ...
set -eu
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
real_cc=$(command -v "${CC:-cc}")
# the kernel's build cache is keyed by the compiler's path: a fixed wrapper path builds the Haswell kernel once, and
# it never replaces the native one
dir="${XDG_CACHE_HOME:-$HOME/.cache}/optimum_pact/avx2_only"
mkdir -p "$dir"
cat > "$dir/cc-haswell" <<SCRIPT
#!/bin/sh
for arg; do shift; [ "\$arg" = -march=native ] && arg=-march=haswell; set -- "\$@" "\$arg"; done
exec "$real_cc" "\$@"
SCRIPT
chmod +x "$dir/cc-haswell"
export CC="$dir/cc-haswell"
"$@"
