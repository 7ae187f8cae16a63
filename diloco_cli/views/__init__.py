"""Views: what a person sees (dry runs, traffic plans, run lists, the status view, logs), built from records
and bucket state; no view writes anything."""
