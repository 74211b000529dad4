-- Sub-bucket sliding-window counters for one request: check every limit, then count
-- the request in all of them or in none (the same arithmetic as
-- gateway/ratelimit/window.py and gateway/counters/memory.py).
--
-- KEYS[i]  one string per limit: an 8-byte header, the sum of the counts, then one
--          16-byte record per counted bucket, oldest first: its index
--          (now_ms // bucket_ms) and its count (at least 1), as little-endian doubles
--          (struct '<dd'), exact for every value a limit can reach. All keys of one
--          call share a hash tag, so one Redis Cluster slot.
-- ARGV     four values per key, in key order: limit, window_ms, bucket_ms, enforce (1|0).
-- Returns  {admitted (1|0), now_ms, then per key: allowed (1|0), remaining, reset_ms}.
--
-- Why this layout (the previous one was a hash of buckets, read whole and sorted on
-- every call: 25 us of server CPU a call on a fresh window, 50-80 us once a window held
-- its ~60 buckets): a call reads each key once, skips the records that left the window,
-- and in the common case writes in place, the newest record and the header (SETRANGE)
-- or one record more (APPEND). Only a call that drops records rewrites the string,
-- which for a busy identity happens once a bucket. Keys of this layout end in ':2' (see
-- redis_backend.KEY_SUFFIX), so gateways of both versions can share one Redis during
-- an upgrade without reading each other's values.
--
-- The time is the store's own (TIME), never a gateway's, so gateways with skewed
-- clocks agree. Records that left the window are dropped by the next call that sees
-- them, and every key expires one window plus one bucket after its newest bucket began
-- (or after the last rewrite), so memory per identity is bounded by the bucket count.

-- Scripts that read TIME and then write must replicate effects, not the script
-- (the default from Redis 5 on; this call is a no-op there and kept for older servers).
if redis.replicate_commands then
  redis.replicate_commands()
end

local pack, unpack = struct.pack, struct.unpack
local floor, tonumber = math.floor, tonumber
local HEAD, REC = 8, 16 -- bytes: the header, one record

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)

-- The records of ``stored`` from byte ``from`` on, with ``bucket`` counted once more, in
-- bucket order. A bucket older than the newest (the store's clock stepped back, after
-- a failover) goes in its place.
local function counted(stored, from, bucket)
  local pos = #stored - REC + 1
  while pos >= from do
    local b, c = unpack('<dd', stored, pos)
    if b == bucket then
      return stored:sub(from, pos - 1) .. pack('<dd', b, c + 1) .. stored:sub(pos + REC)
    elseif b < bucket then
      break
    end
    pos = pos - REC
  end
  return stored:sub(from, pos + REC - 1) .. pack('<dd', bucket, 1) .. stored:sub(pos + REC)
end

-- Milliseconds until the count allows one more request than now (window.ms_until_room),
-- from the records of ``stored`` at byte ``from`` on, oldest first.
local function until_room(stored, from, total, limit, window, width)
  local need = total - limit + 1
  if need < 1 then
    need = 1
  end
  local freed = 0
  for pos = from, #stored - REC + 1, REC do
    local b, c = unpack('<dd', stored, pos)
    freed = freed + c
    if freed >= need then
      local r = (b + 1) * width + window - now
      if r < 0 then
        r = 0
      end
      return r
    end
  end
  return 0
end

local n = #KEYS
local limits, windows, widths, enforced = {}, {}, {}, {}
local stores, froms, totals = {}, {}, {}
local admitted = true

for i = 1, n do
  local arg = (i - 1) * 4
  local limit = tonumber(ARGV[arg + 1])
  local window = tonumber(ARGV[arg + 2])
  local width = tonumber(ARGV[arg + 3])
  local stored = redis.call('GET', KEYS[i])
  local total, from = 0, HEAD + 1
  if stored and #stored >= HEAD and (#stored - HEAD) % REC == 0 then
    total = unpack('<d', stored)
    local oldest, len = floor((now - window) / width), #stored
    while from < len do -- skip the records that left the window
      local b, c = unpack('<dd', stored, from)
      if b >= oldest then
        break
      end
      total = total - c
      from = from + REC
    end
  elseif stored then
    stored = '' -- not this layout: counted from scratch, and rewritten
    from = HEAD + 2
  else
    stored = ''
  end
  limits[i], windows[i], widths[i] = limit, window, width
  enforced[i] = ARGV[arg + 4] == '1'
  stores[i], froms[i], totals[i] = stored, from, total
  if enforced[i] and total >= limit then
    admitted = false
  end
end

local out = {admitted and 1 or 0, now}
for i = 1, n do
  local key = KEYS[i]
  local limit, window, width = limits[i], windows[i], widths[i]
  local stored, from, total = stores[i], froms[i], totals[i]
  local has_room = total < limit
  local dropped = from > HEAD + 1 -- records left the window (or the value was foreign)
  if admitted and has_room then
    local cur = floor(now / width)
    local len = #stored
    local written = false
    total = total + 1
    if not dropped and len > HEAD then
      -- In place: the newest record counted once more, or a new one after it; then the
      -- header. A new bucket pushes the expiry on (one set while this bucket was
      -- current already outlasts it). ``stored`` keeps the first record, all that
      -- until_room reads with room left (every count is at least 1).
      local last = len - REC + 1
      local b, c = unpack('<dd', stored, last)
      if b == cur then
        redis.call('SETRANGE', key, last - 1, pack('<dd', b, c + 1))
        redis.call('SETRANGE', key, 0, pack('<d', total))
        written = true
      elseif b < cur then
        redis.call('APPEND', key, pack('<dd', cur, 1))
        redis.call('SETRANGE', key, 0, pack('<d', total))
        redis.call('PEXPIRE', key, window + width)
        written = true
      end
    end
    if not written then
      stored = pack('<d', total) .. counted(stored, from, cur)
      from = HEAD + 1
      redis.call('SET', key, stored, 'PX', window + width)
    end
  elseif dropped then
    if total > 0 then
      stored = pack('<d', total) .. stored:sub(from)
      from = HEAD + 1
      -- Its newest bucket is still counted, so it began less than a window ago.
      redis.call('SET', key, stored, 'PX', window + width)
    else
      redis.call('DEL', key)
      stored = ''
    end
  end
  local remaining = limit - total
  if remaining < 0 then
    remaining = 0
  end
  out[#out + 1] = has_room and 1 or 0
  out[#out + 1] = remaining
  out[#out + 1] = until_room(stored, from, total, limit, window, width)
end
return out
