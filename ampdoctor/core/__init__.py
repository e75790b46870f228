"""The ground floor (the layer table's foundation, with kinds/): pure Python, no torch at
import. The errors and exit codes, the string enums, the typed evidence, the findings
types, the thresholds, the bounds on hostile input (limits, safetext), the progress
events, memory, the process tree (processes, process_state) and source snippets.
Everything above may import it; it imports nothing of ampdoctor outside itself."""
