-- wrk script for bench/router_bench.py: POST one JSON chat request, the
-- same on every connection.  The runner passes the body in BENCH_BODY;
-- the default lets the script run alone against a target serving
-- "bench-model".
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
if os.getenv("BENCH_AUTH") then
  wrk.headers["Authorization"] = os.getenv("BENCH_AUTH")
end
wrk.body = os.getenv("BENCH_BODY")
  or '{"model":"bench-model","messages":[{"role":"user","content":"Hi"}],'
  .. '"max_tokens":16,"stream":false}'
