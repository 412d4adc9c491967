-- The load of benchmarks/crosscheck.ts, for wrk (LuaJIT), configured by the environment:
--   CROSSCHECK_MODE  fresh: a new key per request; replay: cycle over CROSSCHECK_KEYS keys completed
--                    beforehand ("r-<i>-<tag>"); storm: cycle over CROSSCHECK_KEYS keys ("s-<i>-<tag>")
--   CROSSCHECK_TAG   unique to the measurement, so that no key is ever sent to two of them
--   CROSSCHECK_RUN   unique to the wrk run: a warm-up and the measured load that follows it share
--                    the tag (the replay keys, the storm's keys) but never a fresh key
--   CROSSCHECK_BODY  the JSON request body
-- Keys are RFC 8941 sf-strings (quoted), as the plugin requires. done() prints one line,
-- "CROSSCHECK {json}", that crosscheck.ts reads.

local mode = os.getenv("CROSSCHECK_MODE") or "fresh"
local tag = os.getenv("CROSSCHECK_TAG") or "t"
local run = os.getenv("CROSSCHECK_RUN") or "0"
local keys = tonumber(os.getenv("CROSSCHECK_KEYS") or "100")
local body = os.getenv("CROSSCHECK_BODY") or "{}"

local threads = 0
-- Runs in the main Lua state, once per thread: each thread's `id` (a global of its own state).
function setup(thread)
  thread:set("id", threads)
  threads = threads + 1
end

local counter = 0
local headers = { ["Content-Type"] = "application/json" }

function request()
  counter = counter + 1
  local n = id or 0
  if mode == "fresh" then
    headers["Idempotency-Key"] = '"w-' .. tag .. '-' .. run .. '-' .. n .. '-' .. counter .. '"'
  elseif mode == "replay" then
    -- Threads start apart in the cycle, so that they do not ask for the same key at once.
    headers["Idempotency-Key"] = '"r-' .. ((counter + n * 37) % keys) .. '-' .. tag .. '"'
  else
    headers["Idempotency-Key"] = '"s-' .. (counter % keys) .. '-' .. tag .. '"'
  end
  return wrk.format("POST", "/pay", headers, body)
end

-- errors.status counts responses with a status of 400 or more (a storm's 409s).
function done(summary, latency, requests)
  io.write(string.format(
    'CROSSCHECK {"requests":%d,"durationUs":%d,"bytes":%d,"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d,"p50Us":%d,"p99Us":%d}\n',
    summary.requests, summary.duration, summary.bytes, summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.status, summary.errors.timeout,
    latency:percentile(50), latency:percentile(99)))
end
