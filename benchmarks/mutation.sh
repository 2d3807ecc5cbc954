#!/usr/bin/env bash
# Mutation score of the pure policy modules (docs/mutation.md); a benchmark-style job, not CI.
#
#   benchmarks/mutation.sh            # ~4 min on 2 cores: 3,200-odd mutants
#
# mutmut (configured under [tool.mutmut] in pyproject.toml: the modules, and the unit tests
# that cover them) mutates each module, runs the tests that reach each mutant, and counts a
# mutant killed when a test fails. Prints the count per outcome and per module, and the
# score: killed (timeouts included) over all mutants, "no tests" counting as survivors.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -c "import mutmut" 2>/dev/null || .venv/bin/pip install -q mutmut
rm -rf mutants
.venv/bin/mutmut run --max-children "$(nproc)" >/dev/null 2>&1 || true
.venv/bin/mutmut results --all true 2>/dev/null | awk '
  { module = $1; sub(/:$/, "", module); sub(/\.[^.]*$/, "", module); outcome = $NF
    total++; by[outcome]++; mod[module " " outcome]++
    if (outcome == "killed" || outcome == "timeout") killed++ }
  END {
    for (k in by) printf "%-10s %d\n", k, by[k]
    for (k in mod) printf "  %-40s %d\n", k, mod[k]
    printf "score: %d of %d mutants killed = %.1f%%\n", killed, total, 100 * killed / total
  }'
