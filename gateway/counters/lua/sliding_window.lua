-- Sub-bucket sliding-window counters for one or more requests, in order: for each,
-- check every limit, then count the request in all of them or in none (the same
-- arithmetic as gateway/ratelimit/window.py and gateway/counters/memory.py).
--
-- KEYS     the limits of every request, request after request; one string per limit:
--          16-byte records, one per counted bucket, oldest first (its index,
--          now_ms // bucket_ms, and its count, at least 1), then a 24-byte trailer: the
--          byte offset of the first live record, the sum of the live counts, and when
--          the key expires (ms, the store's clock). All numbers are little-endian
--          doubles (struct '<d'), exact for every value a limit can reach. The keys of
--          one request share a hash tag, so one Redis Cluster slot (a cluster's calls
--          carry the requests of one slot, or of several in the cross-slot form: see
--          cross_slot_prelude.lua), and are distinct (the limiter never repeats one).
-- ARGV     per request one string: per key, in key order, four little-endian doubles
--          (32 bytes): limit, window_ms, bucket_ms, enforce (1|0). Binary, not four
--          decimal strings: a number read with struct costs Redis a fraction of one
--          parsed by tonumber (strtod), and one string a request fewer to make
--          (benchmarks/script_instructions.py).
-- Returns  per request, one after the other: admitted (1|0), now_ms, then per key:
--          allowed (1|0), remaining, reset_ms.
--
-- Why several requests a call: what any call costs Redis (the command, TIME, the Lua
-- call and its reply) is about half of what one request's limits cost it; a gateway
-- sends the requests of one pipeline in one call. Each request is decided as if it came
-- alone, after the ones before it (a key two of them share sees the first one's count).
--
-- Why this layout (the previous one was a hash of buckets, read whole and sorted on
-- every call: 29 us of server CPU a call on a fresh window, 71 us once windows held
-- their ~60 buckets; benchmarks/script_cost.py): a call reads its keys (below) and
-- writes at most a few bytes at each one's end, with one SETRANGE: the newest record
-- counted once more, or a new record, each with the trailer after it. Records that
-- left the window are skipped, not removed (the trailer says where the live ones
-- start); the string is rewritten without them once they are as many as DEAD_MAX. The
-- expiry is pushed on only when a new bucket would outlive it, by two windows, so
-- about once a window.
-- A refused call writes nothing, or when records left the window since the last
-- write, the trailer's first two numbers. Keys of this layout end in ':v2'
-- (limiter.LAYOUT), so gateways of both versions can share one Redis during an upgrade.
--
-- The time is the store's own (TIME), never a gateway's, so gateways with skewed
-- clocks agree. Every key expires at most two windows (plus two buckets) after the last
-- call that counted in it, and holds at most DEAD_MAX records more than its window can
-- hold, so memory per identity is bounded by the bucket count, whatever the limit.

-- Scripts that read TIME and then write must replicate effects, not the script
-- (the default from Redis 5 on; this call is a no-op there and kept for older servers).
if redis.replicate_commands then
  redis.replicate_commands()
end

local spread = unpack -- Lua's own, before ``unpack`` names struct's below
local pack, unpack = struct.pack, struct.unpack
-- (Numbers passed to commands go as format('%d'): Lua's own number-to-string is the
-- float conversion '%.14g', several times dearer.)
local floor, tonumber, format = math.floor, tonumber, string.format
local REC, TAIL = 16, 24 -- bytes: one record, the trailer
local EXACT = 9007199254740992 -- 2^53: doubles are exact integers below it
local DEAD_MAX = 16 -- records left the window kept before the string is rewritten

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
local nargs = #ARGV
-- KEYS and ARGV as the rest reads them. The cross-slot form (cross_slot_text() in
-- gateway/counters/redis_backend.py) replaces the next line with cross_slot_prelude.lua,
-- which builds them (and nargs) from its own layout and reads every key first (``read``).
local KEYS, ARGV, read = KEYS, ARGV, nil

-- The limits must fit the keys, checked before anything is counted or written: a
-- string of 32 bytes a key per request, as many keys in all as KEYS holds.
local keys_of = 0
for r = 1, nargs do
  local size = #ARGV[r]
  if size % 32 ~= 0 then
    return redis.error_reply('sliding_window: ARGV ' .. r .. ' is not 32 bytes a key')
  end
  keys_of = keys_of + size / 32
end
if keys_of ~= #KEYS then
  return redis.error_reply('sliding_window: ' .. #KEYS .. ' keys, limits for ' .. keys_of)
end

-- The value of each distinct key of a call of more than MGET_MIN keys, by key, read
-- with one MGET. A key an earlier request of this call wrote is dropped from it and read
-- again with GET, as it now is; in a call of fewer keys, or past MGET_MAX, every key is
-- read with GET. Counted by benchmarks/script_instructions.py: a call of one to four
-- requests (a Redis Cluster's, a quiet gateway's) costs 4-5 % less with a GET a key
-- than with the MGET and its tables; fifty requests that share their keys (one client's
-- burst) 13 % less with the MGET; fifty of distinct keys about the same either way.
-- MGET answers false for no key and for a key holding another type (an operator's):
-- nothing counted, and written anew with SET if counted, as for no key.
local MGET_MIN = 16 -- keys
local MGET_MAX = 1000 -- keys read at once at most (Lua's stack bounds ``spread``)
local values = read or {}
if read == nil and #KEYS > MGET_MIN and #KEYS <= MGET_MAX then
  local distinct, seen = {}, {}
  for i = 1, #KEYS do
    local key = KEYS[i]
    if not seen[key] then
      seen[key] = true
      distinct[#distinct + 1] = key
    end
  end
  local read = redis.call('MGET', spread(distinct))
  for i = 1, #distinct do
    values[distinct[i]] = read[i]
  end
end

-- The live records of ``stored`` (bytes ``from`` to ``upto``), with ``bucket`` counted
-- once more, in bucket order: a bucket older than the newest (the store's clock stepped
-- back, after a failover) goes in its place.
local function counted(stored, from, upto, bucket)
  local pos = upto - REC + 1
  while pos >= from do
    local b, c = unpack('<dd', stored, pos)
    if b == bucket then
      return stored:sub(from, pos - 1) .. pack('<dd', b, c + 1) .. stored:sub(pos + REC, upto)
    elseif b < bucket then
      break
    end
    pos = pos - REC
  end
  return stored:sub(from, pos + REC - 1) .. pack('<dd', bucket, 1) .. stored:sub(pos + REC, upto)
end

-- Milliseconds until the count allows one more request than now (window.ms_until_room),
-- from the live records (bytes ``from`` to ``upto``), oldest first; ``newer``: a bucket
-- counted after them that they do not hold yet (written in place), or nil.
local function until_room(stored, from, upto, newer, total, limit, window, width)
  local need = total - limit + 1
  if need < 1 then
    need = 1
  end
  local freed, found = 0, nil
  for pos = from, upto - REC + 1, REC do
    local b, c = unpack('<dd', stored, pos)
    freed = freed + c
    if freed >= need then
      found = b
      break
    end
  end
  if found == nil then
    if newer == nil then
      return 0
    end
    found = newer -- with room left, ``need`` is 1: the new record frees it
  end
  local r = (found + 1) * width + window - now
  if r < 0 then
    r = 0
  end
  return r
end

-- One request: its ``n`` keys from KEYS[k0 + 1], their limits packed in ``limits_of``;
-- its answer appended to ``out``.
-- Per key of the request being decided (entries 1 to n), reused from request to request.
local limits, windows, widths, enforced = {}, {}, {}, {}
local stores, froms, uptos, totals, expiries, skipped = {}, {}, {}, {}, {}, {}

local function decide(k0, limits_of, n, out)
  local admitted = true

  for i = 1, n do
    local limit, window, width, enforce = unpack('<dddd', limits_of, i * 32 - 31)
    -- Read above (false: no key, or another type), or now: pcall, so a value of another
    -- type (an operator's) does not fail the other requests of the call. No key, or a
    -- value not of this layout: '' (nothing counted; written anew when counted).
    local key = KEYS[k0 + i]
    local stored = values[key]
    if stored == nil then
      stored = redis.pcall('GET', key)
    end
    local total, from, expires = 0, 1, 0
    local first, upto = 0, 0
    if type(stored) == 'string' and #stored >= TAIL and (#stored - TAIL) % REC == 0 then
      upto = #stored - TAIL
      first, total, expires = unpack('<ddd', stored, upto + 1)
      -- A value of this length that is not a counter (someone else's) is not trusted:
      -- the trailer must point at a record and hold sane numbers (NaN fails these).
      if not (first >= 0 and first <= upto and first % REC == 0
          and total >= 0 and total < EXACT and expires >= 0 and expires < EXACT) then
        stored, first, upto, total, expires = '', 0, 0, 0, 0
      end
    else
      stored = ''
    end
    if stored ~= '' then
      from = first + 1
      local oldest = floor((now - window) / width)
      while from < upto do -- skip the records that left the window
        local b, c = unpack('<dd', stored, from)
        if b >= oldest then
          break
        end
        total = total - c
        from = from + REC
      end
    end
    limits[i], windows[i], widths[i] = limit, window, width
    enforced[i] = enforce == 1
    stores[i], froms[i], uptos[i], totals[i], expiries[i] = stored, from, upto, total, expires
    skipped[i] = from > first + 1
    if enforced[i] and total >= limit then
      admitted = false
    end
  end

  out[#out + 1] = admitted and 1 or 0
  out[#out + 1] = now
  for i = 1, n do
    local key = KEYS[k0 + i]
    local limit, window, width = limits[i], windows[i], widths[i]
    local stored, from, upto = stores[i], froms[i], uptos[i] -- upto: the records' last byte
    local total, expires = totals[i], expiries[i]
    local has_room = total < limit
    local newer = nil
    if admitted and has_room then
      values[key] = nil -- counted: in place or rewritten, below (read again if needed)
      local cur = floor(now / width)
      total = total + 1
      local life = window + width
      local done = false
      if stored ~= '' and (from - 1) / REC < DEAD_MAX then
        -- In place, one write at the end: the newest record counted once more, or a new
        -- one after it, then the trailer. A bucket that would outlive the key's expiry
        -- pushes it on, two lives ahead (so about once a window, not once a bucket).
        local live = from <= upto
        local b, c
        if live then
          b, c = unpack('<dd', stored, upto - REC + 1)
        end
        if live and b == cur then
          local tail = pack('<ddddd', b, c + 1, from - 1, total, expires)
          redis.call('SETRANGE', key, format('%d', upto - REC), tail)
          done = true
        elseif not live or b < cur then
          if now + life > expires then
            expires = now + 2 * life
            redis.call('PEXPIRE', key, format('%d', 2 * life))
          end
          local tail = pack('<ddddd', cur, 1, from - 1, total, expires)
          redis.call('SETRANGE', key, format('%d', upto), tail)
          newer = cur
          done = true
        end
      end
      if not done then
        -- Rewritten whole: a new key, records that left the window dropped, or a clock
        -- that stepped back (then records newer than ``now`` may hold the expiry
        -- further out: it never moves in).
        local records = counted(stored, from, upto, cur)
        if expires < now + 2 * life then
          expires = now + 2 * life
        end
        stored, from, upto = records, 1, #records
        local value = records .. pack('<ddd', 0, total, expires)
        redis.call('SET', key, value, 'PX', format('%d', expires - now))
      end
    elseif skipped[i] then
      -- Not counted, but records left the window: the trailer says so (16 bytes), so a
      -- store clock that later steps back does not count them again.
      values[key] = nil
      redis.call('SETRANGE', key, format('%d', upto), pack('<dd', from - 1, total))
    end
    local remaining = limit - total
    if remaining < 0 then
      remaining = 0
    end
    out[#out + 1] = has_room and 1 or 0
    out[#out + 1] = remaining
    out[#out + 1] = until_room(stored, from, upto, newer, total, limit, window, width)
  end
end

local out = {}
local k0 = 0
for r = 1, nargs do
  local limits_of = ARGV[r]
  local n = #limits_of / 32
  decide(k0, limits_of, n, out)
  k0 = k0 + n
end
return out
