"""Chat-capacity measurement: role-play traffic, closed and open loop, knee sweeps, goodput,
fleet size, report.

workload (persona cards, conversations, profiles) -> loops (closed/open/concurrency) drive
client (streaming, timed from the intended send) over transport (raw asyncio or httpx);
sweep runs the protocol (verified cache reset via server_ops, new seed, telemetry, repeats)
and finds the knee; stats/slo judge runs; fleet sizes replicas; report/console show results.
"""
