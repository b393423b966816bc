--[[ ref_text: the text of the id index's refs "start:offset:seq" (see _refs.lua), apart from
the commands that write them: put (_put.lua) needs no more than these, and every function a script
includes costs each call of it the making of a closure.

score_ref(start_s, score)
  The id-index ref "start:offset:seq" of the message at ``score`` in bucket ``start_s``
  (``score = due + seq/2048``, see keys.py), as put wrote it.

without_ref(refs, ref)
  ``refs`` without ``ref``; false when nothing is left.
]]
local function without_ref(refs, ref)
  if refs == ref then return false end
  local padded = ' ' .. refs .. ' '
  local s, e = string.find(padded, ' ' .. ref .. ' ', 1, true)
  if not s then return refs end
  local rest = string.sub(padded, 1, s) .. string.sub(padded, e + 1)
  rest = string.gsub(string.gsub(rest, '^ +', ''), ' +$', '')
  if rest == '' then return false end
  return rest
end

local function score_ref(start_s, score)
  local due = math.floor(score)
  return start_s .. ':' .. string.format('%d', due - tonumber(start_s)) .. ':'
    .. string.format('%d', (score - due) * 2048)
end
