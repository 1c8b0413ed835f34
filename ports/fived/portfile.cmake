# vcpkg overlay port of fived, from this repository's sources:
#   vcpkg install fived --overlay-ports=<fived>/ports
# A header-only library: one release configuration, no binaries.
set(VCPKG_BUILD_TYPE release)
get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
include("${CMAKE_CURRENT_LIST_DIR}/options.cmake")

vcpkg_cmake_configure(SOURCE_PATH "${SOURCE_PATH}" OPTIONS ${FIVED_PORT_OPTIONS})
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME fived CONFIG_PATH share/fived)
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/lib")
# fived has no license file yet: the README stands in for the copyright vcpkg requires.
file(INSTALL "${SOURCE_PATH}/README.md" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}" RENAME copyright)
