"""Worker-side transfers: jobs batched onto transfer threads, polled, fenced and cancelled."""
