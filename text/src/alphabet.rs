//! GPT-2's byte-level alphabet: the printable character each byte is written as in a
//! byte-level BPE vocabulary. The tokenizer and the fast encoder both map through it.

/// Whether GPT-2's byte-level alphabet writes byte `b` as the character of the same code.
fn printable(b: u32) -> bool {
    (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b)
}

/// The byte GPT-2's byte-level alphabet writes as `c`, if `c` belongs to that alphabet.
pub(crate) fn byte_of_char(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp < 256 {
        return printable(cp).then_some(cp as u8);
    }
    // The other 68 bytes are written as U+0100 onwards, in byte order.
    let n = (cp - 256) as usize;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(n)
        .map(|b| b as u8)
}

/// The character GPT-2's byte-level alphabet writes byte `b` as.
pub(crate) fn char_of_byte(b: u8) -> char {
    if printable(u32::from(b)) {
        return char::from(b);
    }
    let n = (0..u32::from(b)).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap_or(char::REPLACEMENT_CHARACTER)
}
