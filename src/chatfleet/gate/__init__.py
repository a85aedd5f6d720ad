"""Quality gate: a candidate serving configuration against stock on GSM8K, tool calls and
role-play likelihood, decided by paired statistics (``chatfleet gate``)."""
