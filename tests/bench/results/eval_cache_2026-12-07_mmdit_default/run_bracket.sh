#!/usr/bin/env bash
# One more fbcache point for run.sh's grid (same seeds and settings): fbcache:thr=0.12, slower than the grid's fbcache
# points, so that fbcache's frontier brackets the default freq's full-step speed-up too.
MODES="off;fbcache:thr=0.12" OUT=grid_bracket exec "$(dirname "$0")/run.sh" "$@"
