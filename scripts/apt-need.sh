#!/bin/sh
# What `make system-deps` installs, one package set at a time:
#   apt-need.sh "COMMANDS" "PACKAGES" "WHAT FOR" "WHAT IS SKIPPED WITHOUT THEM" [APT OPTIONS]
# Nothing happens when every command is on PATH. As root with apt-get the packages are
# installed (apt-get update first only if the install fails); otherwise it says what to
# install and which tests will be skipped.
cmds=$1 pkgs=$2 why=$3 skipped=$4 opts=${5:-}
missing=
for c in $cmds; do command -v "$c" >/dev/null 2>&1 || missing="$missing $c"; done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "==> installing $pkgs $why (apt)"
  # shellcheck disable=SC2086 # the package and option lists are word lists
  apt-get install -y -q $opts $pkgs >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q $opts $pkgs >/dev/null; }
else
  echo "!!$missing missing: install $pkgs (apt-get install $pkgs); $skipped will be skipped"
fi
