"""Settings, one table validated at start-up, and the trace ranges they switch on."""
