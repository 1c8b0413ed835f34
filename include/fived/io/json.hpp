#pragma once
// A strict reader of the JSON that fived's files carry (a safetensors header, a checkpoint
// manifest): objects, arrays, strings with every escape and their UTF-8 checked, and
// non-negative integers; any other value can be skipped where its key is unknown. Errors
// name the file, what the text is, the byte offset in the file and what was expected, and
// are thrown as the format's own error type:
//
//   io::JsonReader<io::SafetensorsError> P(text, "m.safetensors", 8, "safetensors header");
//   P.expect('{', "'{' to start the header");
//   const std::string key = P.string("a tensor name");
//   const std::vector<std::uint64_t> shape = P.uint_array("shape");
//
// And the writer's half: json_string(out, s) appends s as a JSON string.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fived::io {

// The reader. Error: the exception type, constructible from a std::string.
template <class Error>
class JsonReader {
 public:
  // text: the JSON; source: the file, in errors; base: the text's byte offset in that file;
  // kind: what the text is ("safetensors header", "checkpoint manifest").
  JsonReader(std::string_view text, std::string source, std::size_t base, std::string kind)
      : s_(text), source_(std::move(source)), base_(base), kind_(std::move(kind)) {}

  [[noreturn]] void fail(const std::string& what) const { fail_at(pos_, what); }
  [[noreturn]] void fail_at(std::size_t pos, const std::string& what) const {
    throw Error(source_ + ": " + kind_ + ", byte " + std::to_string(base_ + pos) + " of the file: " + what);
  }

  std::string found() const {
    if (pos_ >= s_.size()) return "the end of the header";
    const unsigned char c = static_cast<unsigned char>(s_[pos_]);
    if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
    char buf[16];
    std::snprintf(buf, sizeof buf, "byte 0x%02x", c);
    return buf;
  }

  void ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool at_end() const { return pos_ >= s_.size(); }
  std::size_t pos() const { return pos_; }
  bool peek(char c) {
    ws();
    return pos_ < s_.size() && s_[pos_] == c;
  }
  void expect(char c, std::string_view what) {
    ws();
    if (pos_ >= s_.size() || s_[pos_] != c) fail("expected " + std::string(what) + ", found " + found());
    ++pos_;
  }

  std::string string(std::string_view what) {
    ws();
    if (pos_ >= s_.size() || s_[pos_] != '"') fail("expected " + std::string(what) + " (a JSON string), found " + found());
    const std::size_t start = pos_;
    ++pos_;
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail_at(start, "unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail_at(pos_ - 1, "control character inside a string (must be escaped)");
      if (static_cast<unsigned char>(c) >= 0x80) {  // a multi-byte character: copied once it is valid UTF-8
        const std::size_t n = utf8_length(pos_ - 1);
        out.append(s_.substr(pos_ - 1, n));
        pos_ += n - 1;
        continue;
      }
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail_at(start, "unterminated string");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xd800 && cp < 0xdc00) {  // surrogate pair
            if (pos_ + 1 >= s_.size() || s_[pos_] != '\\' || s_[pos_ + 1] != 'u')
              fail("expected a low surrogate \\uDC00-\\uDFFF after a high surrogate");
            pos_ += 2;
            const std::uint32_t lo = hex4();
            if (lo < 0xdc00 || lo >= 0xe000) fail_at(pos_ - 4, "expected a low surrogate \\uDC00-\\uDFFF");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          } else if (cp >= 0xdc00 && cp < 0xe000) {
            fail_at(pos_ - 4, "unpaired low surrogate");
          }
          utf8(out, cp);
          break;
        }
        default: fail_at(pos_ - 1, std::string("unknown escape \\") + e);
      }
    }
  }

  // A non-negative JSON integer (no sign, fraction or exponent).
  std::uint64_t uint(std::string_view what) {
    ws();
    if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9')
      fail("expected " + std::string(what) + " (a non-negative integer), found " + found());
    const std::size_t start = pos_;
    std::uint64_t v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      const std::uint64_t d = static_cast<std::uint64_t>(s_[pos_] - '0');
      if (v > (UINT64_MAX - d) / 10) fail_at(start, std::string(what) + " does not fit in 64 bits");
      v = v * 10 + d;
      ++pos_;
    }
    if (pos_ - start > 1 && s_[start] == '0') fail_at(start, std::string(what) + " has a leading zero");
    if (pos_ < s_.size() && (s_[pos_] == '.' || s_[pos_] == 'e' || s_[pos_] == 'E'))
      fail("expected " + std::string(what) + " to be an integer, found a fraction or exponent");
    return v;
  }

  // [u, u, ...]
  std::vector<std::uint64_t> uint_array(std::string_view what) {
    expect('[', "'[' to start " + std::string(what));
    std::vector<std::uint64_t> v;
    if (peek(']')) {
      ++pos_;
      return v;
    }
    for (;;) {
      v.push_back(uint(std::string(what) + " element"));
      ws();
      if (peek(']')) {
        ++pos_;
        return v;
      }
      expect(',', "',' or ']' in " + std::string(what));
    }
  }

  // Skips any JSON value (for keys this reader does not know).
  void skip_value(int depth = 0) {
    if (depth > 64) fail("JSON nested too deeply");
    ws();
    if (pos_ >= s_.size()) fail("expected a JSON value, found the end of the header");
    const char c = s_[pos_];
    if (c == '"') {
      string("a string");
    } else if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++pos_;
      if (peek(close)) {
        ++pos_;
        return;
      }
      for (;;) {
        if (c == '{') {
          string("an object key");
          expect(':', "':' after an object key");
        }
        skip_value(depth + 1);
        if (peek(close)) {
          ++pos_;
          return;
        }
        expect(',', std::string("',' or '") + close + "'");
      }
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      ++pos_;
      while (pos_ < s_.size() && std::strchr("0123456789.eE+-", s_[pos_]) != nullptr && s_[pos_] != '\0') ++pos_;
    } else if (literal("true") || literal("false") || literal("null")) {
    } else {
      fail("expected a JSON value, found " + found());
    }
  }

  // The literal w (true, false, null) at the next non-space, consumed; false if it is not there.
  bool literal(std::string_view w) {
    ws();
    if (s_.substr(pos_, w.size()) != w) return false;
    pos_ += w.size();
    return true;
  }

 private:
  // The length of the UTF-8 character that starts at byte `at`, which must be well formed
  // (RFC 3629): no stray continuation byte, no overlong form, no surrogate, nothing above
  // U+10FFFF. JSON text is UTF-8, and the format requires tensor names to be.
  std::size_t utf8_length(std::size_t at) const {
    const auto byte = [&](std::size_t i) { return i < s_.size() ? static_cast<unsigned char>(s_[i]) : 0u; };
    const unsigned lead = byte(at);
    std::size_t n = 0;
    unsigned lo = 0x80, hi = 0xbf;  // the range of the second byte
    if (lead >= 0xc2 && lead <= 0xdf) n = 2;
    else if (lead >= 0xe0 && lead <= 0xef) n = 3, lo = lead == 0xe0 ? 0xa0 : 0x80, hi = lead == 0xed ? 0x9f : 0xbf;
    else if (lead >= 0xf0 && lead <= 0xf4) n = 4, lo = lead == 0xf0 ? 0x90 : 0x80, hi = lead == 0xf4 ? 0x8f : 0xbf;
    else fail_at(at, "invalid UTF-8 in a string (a stray, overlong or out-of-range lead byte)");
    for (std::size_t i = 1; i < n; ++i) {
      const unsigned c = byte(at + i);
      if (c < (i == 1 ? lo : 0x80u) || c > (i == 1 ? hi : 0xbfu))
        fail_at(at + i, "invalid UTF-8 in a string (an overlong form, a surrogate, a code point above U+10FFFF or "
                        "a missing continuation byte)");
    }
    return n;
  }
  std::uint32_t hex4() {
    if (pos_ + 4 > s_.size()) fail("expected 4 hex digits after \\u");
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = s_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= static_cast<std::uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f') v |= static_cast<std::uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') v |= static_cast<std::uint32_t>(h - 'A' + 10);
      else fail_at(pos_ - 1, "expected a hex digit after \\u");
    }
    return v;
  }
  static void utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  std::string_view s_;
  std::string source_;
  std::size_t base_;
  std::string kind_;
  std::size_t pos_ = 0;
};

// Appends s to out as a JSON string (quotes, backslashes and control characters escaped).
inline void json_string(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (u < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", u);
      out += buf;
    } else out += c;
  }
  out += '"';
}

}  // namespace fived::io
