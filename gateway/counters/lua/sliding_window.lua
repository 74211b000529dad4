-- Sub-bucket sliding-window counters for one request: check every limit, then count
-- the request in all of them or in none (the same arithmetic as
-- gateway/ratelimit/window.py and gateway/counters/memory.py).
--
-- KEYS[i]  one hash per limit; field = bucket index (now_ms // bucket_ms), value = count.
--          All keys of one call share a hash tag, so one Redis Cluster slot.
-- ARGV     four values per key, in key order: limit, window_ms, bucket_ms, enforce (1|0).
-- Returns  {admitted (1|0), now_ms, then per key: allowed (1|0), remaining, reset_ms}.
--
-- The time is the store's own (TIME), never a gateway's, so gateways with skewed
-- clocks agree. Fields older than the trailing window are deleted on every call and
-- every counted key expires one window plus one bucket after its newest bucket began, so
-- memory per identity is bounded by the bucket count, whatever the limit.

-- Scripts that read TIME and then write must replicate effects, not the script
-- (the default from Redis 5 on; this call is a no-op there and kept for older servers).
if redis.replicate_commands then
  redis.replicate_commands()
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local n = #KEYS
local limits, windows, widths, enforced = {}, {}, {}, {}
local bucket_lists, bucket_counts, totals = {}, {}, {}
local admitted = true

for i = 1, n do
  local base = (i - 1) * 4
  local limit = tonumber(ARGV[base + 1])
  local window = tonumber(ARGV[base + 2])
  local width = tonumber(ARGV[base + 3])
  local oldest = math.floor((now - window) / width)
  local flat = redis.call('HGETALL', KEYS[i])
  local list, counts, stale = {}, {}, {}
  local total = 0
  for j = 1, #flat, 2 do
    local b = tonumber(flat[j])
    if b < oldest then
      stale[#stale + 1] = flat[j]
    else
      local c = tonumber(flat[j + 1])
      list[#list + 1] = b
      counts[b] = c
      total = total + c
    end
  end
  if #stale > 0 then
    redis.call('HDEL', KEYS[i], unpack(stale))
  end
  limits[i], windows[i], widths[i] = limit, window, width
  enforced[i] = ARGV[base + 4] == '1'
  bucket_lists[i], bucket_counts[i], totals[i] = list, counts, total
  if enforced[i] and total >= limit then
    admitted = false
  end
end

-- Milliseconds until the count allows one more request than now (window.ms_until_room).
local function until_room(list, counts, total, limit, window, width)
  local need = total - limit + 1
  if need < 1 then
    need = 1
  end
  local freed = 0
  for _, b in ipairs(list) do
    local c = counts[b]
    if c > 0 then
      freed = freed + c
      if freed >= need then
        local r = (b + 1) * width + window - now
        if r < 0 then
          r = 0
        end
        return r
      end
    end
  end
  return 0
end

local out = {admitted and 1 or 0, now}
for i = 1, n do
  local limit, window, width = limits[i], windows[i], widths[i]
  local list, counts, total = bucket_lists[i], bucket_counts[i], totals[i]
  local has_room = total < limit
  if admitted and has_room then
    local cur = math.floor(now / width)
    redis.call('HINCRBY', KEYS[i], string.format('%d', cur), 1)
    if counts[cur] == nil then
      -- Only a new bucket needs a later expiry: one set while this bucket was
      -- current already outlasts it (the key lives until its newest bucket leaves).
      redis.call('PEXPIRE', KEYS[i], window + width)
      counts[cur] = 0
      list[#list + 1] = cur
    end
    counts[cur] = counts[cur] + 1
    total = total + 1
  end
  table.sort(list)
  local remaining = limit - total
  if remaining < 0 then
    remaining = 0
  end
  out[#out + 1] = has_room and 1 or 0
  out[#out + 1] = remaining
  out[#out + 1] = until_room(list, counts, total, limit, window, width)
end
return out
