#!/bin/sh
# Print the lock file of an environment: a header, then every installed distribution as
# name==version (moremoe itself and the installers left out), sorted. `make lock` runs it on
# a fresh environment of the newest versions pyproject.toml allows.
set -eu
PY="$1"
cat <<HEAD
# The exact versions \`make demo\` and \`make test\` install on a CPU machine (scripts/install.sh
# locked), and the set the test suite passed with. Regenerate with \`make lock\` after any
# change of dependencies in pyproject.toml, then run \`make test\` before committing it.
# Written $(date -u +%Y-%m-%d) by \`make lock\` on $("$PY" -c 'import platform; print(f"Python {platform.python_version()}, {platform.system()} {platform.machine()}")').
HEAD
"$PY" -m pip freeze --exclude-editable | grep -v -i -E '^(pip|setuptools|wheel|moremoe)==' \
    | LC_ALL=C sort -f
