"""One router per resource: studies, trials, health."""
