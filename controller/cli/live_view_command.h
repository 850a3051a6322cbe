// `fracgpu status --watch [SECONDS]` and `fracgpu top`: the live view of
// state/live_view.h, redrawn in place on a terminal (plain ANSI: cursor
// home, clear to the end of each line and of the screen, cursor hidden and
// line wrap off while it runs), or printed frame after frame, a blank line
// between, when stdout is not a terminal. Ctrl-C, SIGTERM and SIGHUP end it
// with exit code 0 and the terminal as it was; Ctrl-Z suspends it with the
// terminal restored. It sleeps between readings (sigtimedwait), never spins.
#pragma once

#include <string>

#include "state/live_view.h"

namespace fracgpu::controller {

struct LiveViewOptions {
  std::string run_dir;
  std::string title;   // shown first in the header: "fracgpu top"
  double interval_s = 1;
  LiveOrder order = LiveOrder::kGpu;
  unsigned count = 0;  // stop after this many frames; 0: until a signal
};

// Runs the view. Returns kStatusOk (0) when stopped by a signal or after
// `count` frames; kStatusNoRunDir (1) if the run dir cannot be read at the
// start (later, that is shown in the frame and retried).
int run_live_view(const LiveViewOptions& options);

}  // namespace fracgpu::controller
