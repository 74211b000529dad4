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
-- their ~60 buckets; benchmarks/script_cost.py): a call reads each of its keys once
-- (below) and writes at most a few bytes at each one's end, with one SETRANGE however
-- many of its requests count there: the newest record counted once more, or a new
-- record, with the trailer after it. Records that
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

-- How many requests of the call use each key (a request's own keys are distinct): a key
-- that several use (one client's burst, in a gateway's pipeline) is read once, kept as
-- numbers from its first request to its last, and written once, after its last; each
-- request after the first costs a few additions, not a read, a parse and a write
-- (benchmarks/README.md, "thirteenth step"). ``uses`` is nil in a call of one request
-- of few keys.
--
-- The value of each distinct key of a call of more than MGET_MIN keys is read with one
-- MGET; in a call of fewer keys, or past MGET_MAX, each key is read with GET by its first
-- request. Counted by benchmarks/script_instructions.py: a call of one to four
-- requests (a Redis Cluster's, a quiet gateway's) costs 4-5 % less with a GET a key
-- than with the MGET and its tables; fifty requests that share their keys (one client's
-- burst) 13 % less with the MGET; fifty of distinct keys about the same either way.
-- MGET answers false for no key and for a key holding another type (an operator's):
-- nothing counted, and written anew with SET if counted, as for no key.
local MGET_MIN = 16 -- keys
local MGET_MAX = 1000 -- keys read at once at most (Lua's stack bounds ``spread``)
local values = read or {}
local mget = read == nil and #KEYS > MGET_MIN and #KEYS <= MGET_MAX
local uses, distinct, repeated = nil, mget and {}, false
if nargs > 1 or mget then
  uses = {}
  for i = 1, #KEYS do
    local key = KEYS[i]
    local n = uses[key]
    if n == nil then
      uses[key] = 1
      if mget then
        distinct[#distinct + 1] = key
      end
    else
      uses[key] = n + 1
      repeated = true
    end
  end
end
if mget then
  local got = redis.call('MGET', spread(distinct))
  for i = 1, #distinct do
    values[distinct[i]] = got[i]
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

-- What keys several requests use need, made only for a call that has such keys, in one
-- table (``kept``: each function a call makes, and each name ``decide`` takes from
-- outside it, costs Redis per call).
local kept = false
if repeated then
  local states, held = {}, {} -- by key; per key of the request being decided (or false)
  -- A key as the requests of the call so far have left it, as numbers:
  --   rec      bytes 1 .. upto - REC are the value's records but the last, as stored;
  --            the last one is ``lb``, ``lc`` (its bytes in ``rec`` are stale once
  --            ``moved``: counted again since it was read)
  --   from     the first live record's first byte; upto: the last record's last byte
  --   lb, lc   the last record (bucket, count); lb false when the value holds none
  --   total    the sum of the live records' counts; expires: when the key expires (ms)
  --   valid    false: no value of this layout (nothing counted; written whole if counted)
  --   changed  false, or the byte from which the value differs from what Redis holds
  --            (-1: to be written whole); pushed: its expiry moved on
  -- Only a key several requests use is kept so (a table of its own, in ``kept``, made with
  -- every field: a table made, or a field added later, costs Redis about as much as the
  -- rest of a key's work); a key one request uses is decided and written by that request,
  -- from locals (``decide``).
  local function new_state()
    return {
      rec = '', from = 1, upto = 0, total = 0, expires = 0, valid = false,
      lb = false, lc = 0, moved = false, changed = false, pushed = false,
    }
  end

  -- ``state`` set to ``key``'s value: read above (false: no key, or another type), or now
  -- with pcall, so a value of another type (an operator's) does not fail the other
  -- requests of the call. No key, or a value not of this layout: nothing counted
  -- (written anew when counted).
  local function load(state, key)
    local stored = values[key]
    if stored == nil then
      stored = redis.pcall('GET', key)
    end
    state.moved, state.changed, state.pushed = false, false, false
    if type(stored) == 'string' and #stored >= TAIL and (#stored - TAIL) % REC == 0 then
      local upto = #stored - TAIL
      local first, total, expires = unpack('<ddd', stored, upto + 1)
      -- A value of this length that is not a counter (someone else's) is not trusted:
      -- the trailer must point at a record and hold sane numbers (NaN fails these).
      if first >= 0 and first <= upto and first % REC == 0
          and total >= 0 and total < EXACT and expires >= 0 and expires < EXACT then
        state.rec, state.from, state.upto, state.total, state.expires = stored, first + 1, upto, total, expires
        state.valid = true
        if upto >= REC then
          state.lb, state.lc = unpack('<dd', stored, upto - REC + 1)
        else
          state.lb, state.lc = false, 0
        end
        return
      end
    end
    state.rec, state.from, state.upto, state.total, state.expires = '', 1, 0, 0, 0
    state.valid, state.lb, state.lc = false, false, 0
  end

  -- Skips the records that left the window (older than bucket ``oldest``): whether any did.
  -- (Locals and struct's own unpack in the loop: an identity seen every few seconds skips
  -- tens of records a call.)
  local function trim(state, oldest)
    local rec, from, total = state.rec, state.from, state.total
    local last = state.upto - REC + 1 -- the last record's first byte: lb, lc
    while from < last do
      local b, c = unpack('<dd', rec, from)
      if b >= oldest then
        break
      end
      total = total - c
      from = from + REC
    end
    if from == last and state.lb < oldest then
      total = total - state.lc
      from = from + REC
    end
    if from == state.from then
      return false
    end
    state.from, state.total = from, total
    return true
  end

  -- Notes that ``state`` now differs from what Redis holds from byte ``offset`` on (-1:
  -- whole). Every change keeps the bytes before it and never shortens the value (a
  -- rewrite is whole), so one write of the bytes from the lowest changed on is enough.
  local function changed(state, offset)
    local was = state.changed
    if was == false or offset < was then
      state.changed = offset
    end
  end

  -- The value's records, all of them, as stored bytes (the last one from ``lb``, ``lc``).
  local function records_of(state)
    if state.lb == false then
      return state.rec:sub(1, state.upto)
    end
    return state.rec:sub(1, state.upto - REC) .. pack('<dd', state.lb, state.lc)
  end

  -- ``bucket`` counted once more in ``state`` (for a window of ``life`` less a bucket): the
  -- newest record counted again, or a new one after it, in place (what changes is the last
  -- record and the trailer, or a new record and the trailer); or the records rewritten
  -- whole, without those that left the window (once they are DEAD_MAX), on a new value, or
  -- when the clock stepped back (a bucket older than the newest).
  local function count(state, bucket, life)
    local live = state.from <= state.upto
    if state.valid and (state.from - 1) / REC < DEAD_MAX then
      if live and state.lb == bucket then
        state.lc = state.lc + 1
        state.total = state.total + 1
        state.moved = true
        changed(state, state.upto - REC)
        return
      elseif not live or state.lb < bucket then
        if now + life > state.expires then
          -- A bucket that would outlive the key's expiry pushes it on, two lives ahead
          -- (so about once a window, not once a bucket).
          state.expires = now + 2 * life
          state.pushed = true
        end
        changed(state, state.upto)
        if state.moved then -- ``rec`` must hold the record that is no longer the last
          state.rec, state.moved = records_of(state), false
        end
        state.upto = state.upto + REC
        state.lb, state.lc = bucket, 1
        state.total = state.total + 1
        state.moved = true -- the new record is not in ``rec``
        return
      end
    end
    -- Rewritten whole: a new key, records that left the window dropped, or a clock that
    -- stepped back (then records newer than ``now`` may hold the expiry further out: it
    -- never moves in).
    local records = counted(records_of(state), state.from, state.upto, bucket)
    if state.expires < now + 2 * life then
      state.expires = now + 2 * life
    end
    state.rec, state.from, state.upto = records, 1, #records
    state.lb, state.lc = unpack('<dd', records, #records - REC + 1)
    state.total = state.total + 1
    state.valid, state.moved = true, false
    changed(state, -1)
  end

  -- What changed in ``key``'s value, written: whole, with its expiry; or the bytes from
  -- the first that changed (records before the last one as stored, then the last one and
  -- the trailer), and the expiry when a new bucket pushed it on.
  local function write(key, state)
    local offset = state.changed
    if offset == false then
      return
    end
    local last = state.upto - REC
    local tail = pack('<ddddd', state.lb, state.lc, state.from - 1, state.total, state.expires)
    if offset < 0 then
      local value = state.rec:sub(1, last) .. tail
      redis.call('SET', key, value, 'PX', format('%d', state.expires - now))
      return
    end
    if offset >= last then
      tail = tail:sub(offset - last + 1)
    else
      tail = state.rec:sub(offset + 1, last) .. tail
    end
    redis.call('SETRANGE', key, format('%d', offset), tail)
    if state.pushed then
      redis.call('PEXPIRE', key, format('%d', state.expires - now))
    end
  end

  -- until_room() of a kept key's ``state``.
  local function room_in(state, limit, window, width)
    local need = state.total - limit + 1
    if need < 1 then
      need = 1
    end
    local freed, found = 0, nil
    local rec, pos, last = state.rec, state.from, state.upto - REC + 1
    while pos < last do
      local b, c = unpack('<dd', rec, pos)
      freed = freed + c
      if freed >= need then
        found = b
        break
      end
      pos = pos + REC
    end
    if found == nil and pos == last and freed + state.lc >= need then
      found = state.lb
    end
    if found == nil then
      return 0
    end
    local r = (found + 1) * width + window - now
    if r < 0 then
      r = 0
    end
    return r
  end

  -- One request's answer for a key kept for several requests (``decide``'s second half).
  local function answer(key, state, admitted, skipped, limit, window, width, out)
    local has_room = state.total < limit
    if admitted and has_room then
      count(state, floor(now / width), window + width)
    elseif skipped then
      -- Not counted, but records left the window: the trailer says so (as below).
      changed(state, state.upto)
    end
    local remaining = limit - state.total
    if remaining < 0 then
      remaining = 0
    end
    out[#out + 1] = has_room and 1 or 0
    out[#out + 1] = remaining
    out[#out + 1] = room_in(state, limit, window, width)
    local left = uses[key] - 1
    uses[key] = left
    if left == 0 then -- the key's last request in this call
      write(key, state)
    end
  end

  kept = {
    -- The state of the ``i``th key of the request being decided, ``key``, or false if
    -- no other request of the call uses it.
    state = function(key, i)
      local state = states[key]
      if state == nil then
        if uses[key] == 1 then
          held[i] = false
          return false
        end
        state = new_state()
        load(state, key)
        states[key] = state
      end
      held[i] = state
      return state
    end,
    held = held,
    trim = trim,
    answer = answer,
  }
end

-- One request: its ``n`` keys from KEYS[k0 + 1], their limits packed in ``limits_of``;
-- its answer appended to ``out``.
-- Per key of the request being decided (entries 1 to n), reused from request to request.
local limits, windows, widths, enforced = {}, {}, {}, {}
local stores, froms, uptos, totals, expiries, skipped = {}, {}, {}, {}, {}, {}
local firsts = {} -- the first live record's bucket, false or nil (``first_b`` below)

local function decide(k0, limits_of, n, out)
  local admitted = true

  for i = 1, n do
    local limit, window, width, enforce = unpack('<dddd', limits_of, i * 32 - 31)
    -- Read above (false: no key, or another type), or now: pcall, so a value of another
    -- type (an operator's) does not fail the other requests of the call. No key, or a
    -- value not of this layout: '' (nothing counted; written anew when counted).
    local key = KEYS[k0 + i]
    local state = kept and kept.state(key, i)
    local stored = '' -- a kept key's value is its state's
    if not state then
      stored = values[key]
      if stored == nil then
        stored = redis.pcall('GET', key)
      end
    end
    local total, from, expires = 0, 1, 0
    local first, upto = 0, 0
    -- The first live record's bucket as the trim below finds it (false: no live record),
    -- nil where it is not known (a kept key, a rewritten value): then until_room() reads it.
    local first_b = false
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
          first_b = b
          break
        end
        total = total - c
        from = from + REC
      end
    end
    if state then
      skipped[i] = state.valid and kept.trim(state, floor((now - window) / width))
      total = state.total
    else
      skipped[i] = from > first + 1
    end
    limits[i], windows[i], widths[i] = limit, window, width
    enforced[i] = enforce == 1
    stores[i], froms[i], uptos[i], totals[i], expiries[i] = stored, from, upto, total, expires
    firsts[i] = first_b
    if enforced[i] and total >= limit then
      admitted = false
    end
  end

  out[#out + 1] = admitted and 1 or 0
  out[#out + 1] = now
  for i = 1, n do
    local key = KEYS[k0 + i]
    local limit, window, width = limits[i], windows[i], widths[i]
    local state = kept and kept.held[i]
    if state then
      kept.answer(key, state, admitted, skipped[i], limit, window, width, out)
    else
      local stored, from, upto = stores[i], froms[i], uptos[i] -- upto: the records' last byte
      local total, expires = totals[i], expiries[i]
      local first_b = firsts[i]
      local has_room = total < limit
      local newer = nil
      if admitted and has_room then
        -- A later read of this key in the call would take the written value, not this
        -- one. The gateway never sends one (a request's keys are distinct, and a key
        -- several requests use takes the kept path above); kept for a caller that would.
        values[key] = nil
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
          first_b = nil -- (the new bucket may be the first record now)
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
      if first_b ~= nil and total <= limit then
        -- until_room() with ``need`` 1, without reading the record again: the first live
        -- record frees it (every record counts at least 1), else the one just counted.
        local found = first_b or newer
        local r = 0
        if found then
          r = (found + 1) * width + window - now
          if r < 0 then
            r = 0
          end
        end
        out[#out + 1] = r
      else
        out[#out + 1] = until_room(stored, from, upto, newer, total, limit, window, width)
      end
    end
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
