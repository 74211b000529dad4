-- PROBE ONLY, never shipped: an upper bound, not a counter. It answers every request of
-- a call as sliding_window.lua's reply shape says (admitted, now_ms, then per key
-- allowed, remaining, reset_ms) and reads and writes no key. Put in place of
-- gateway/counters/lua/sliding_window.lua in a copy of a built checkout, it measures what
-- the Redis row would gain if the counter script cost Redis nothing (benchmarks/README.md,
-- "Third round, seventeenth step").
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local nargs = #ARGV
local KEYS, ARGV, read = KEYS, ARGV, nil
local out = {}
for r = 1, nargs do
  local n = #ARGV[r] / 32
  out[#out + 1] = 1
  out[#out + 1] = now
  for _ = 1, n do
    out[#out + 1] = 1
    out[#out + 1] = 100
    out[#out + 1] = 0
  end
end
return out
