// Redis Cluster's hash slot of a key (CRC16-XMODEM of the key, or of its
// hash tag, modulo 16384) and the Functions library's outbox key for a
// record key (spec/outbox_slots.json: prefix + tags[slot] + suffix), which
// idem_complete is given as its second key so both share one slot.
import * as spec from "./spec.js";

export const SLOTS = 16384;

const TABLE = (() => {
  const t = new Uint16Array(256);
  for (let i = 0; i < 256; i++) {
    let crc = i << 8;
    for (let bit = 0; bit < 8; bit++) crc = crc & 0x8000 ? ((crc << 1) ^ 0x1021) & 0xffff : (crc << 1) & 0xffff;
    t[i] = crc;
  }
  return t;
})();

/** CRC16-XMODEM (polynomial 0x1021, initial 0), as Redis Cluster hashes keys. */
export function crc16(bytes: Uint8Array): number {
  let crc = 0;
  for (const byte of bytes) crc = ((crc << 8) & 0xffff) ^ (TABLE[((crc >> 8) ^ byte) & 0xff] as number);
  return crc;
}

/** The bytes Redis Cluster hashes: the hash tag (between the first `{` and the next `}`, when not empty), else the key. */
export function hashTag(key: Uint8Array): Uint8Array {
  const open = key.indexOf(0x7b);
  if (open < 0) return key;
  const close = key.indexOf(0x7d, open + 1);
  if (close < 0 || close === open + 1) return key;
  return key.subarray(open + 1, close);
}

/** The key's hash slot (0..16383). */
export function slot(key: string | Uint8Array): number {
  const bytes = typeof key === "string" ? Buffer.from(key, "utf8") : key;
  return crc16(hashTag(bytes)) % SLOTS;
}

/** The library's outbox for a record key: in the key's slot (spec/outbox_slots.json). */
export function outboxKey(key: string | Uint8Array): string {
  const o = spec.outboxSlots();
  const tag = o.tags[slot(key)];
  if (tag === undefined) throw new Error(`spec/outbox_slots.json has no tag for slot ${slot(key)}`);
  return `${o.prefix}${tag}${o.suffix}`;
}
